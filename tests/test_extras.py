"""The install hint of a missing extra (issue 26): bnswap is not on PyPI, so
``pip install 'bnswap[lightning]'`` could not work; the hint names what does, from where
this bnswap was installed (its ``direct_url.json``, PEP 610). tests/test_install.py runs
it for real from a wheel in a fresh environment (the wheel, then the wheel gone)."""

from __future__ import annotations

import pathlib

import pytest

from bnswap import extras

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_each_kind_of_installation_gets_a_command_that_works_from_it(tmp_path):
    """``direct_url.json`` as pip writes it (PEP 610's examples), run through the rule."""
    checkout = tmp_path / "bnswap"
    checkout.mkdir()
    wheel = tmp_path / "dist" / "bnswap-0.1.0-py3-none-any.whl"
    wheel.parent.mkdir()
    wheel.write_bytes(b"")
    url = checkout.as_uri()
    cases = [
        ({"url": url, "dir_info": {}}, f"pip install '{checkout}[lightning]'"),
        ({"url": url, "dir_info": {"editable": True}}, f"pip install -e '{checkout}[lightning]'"),
        (
            {"url": wheel.as_uri(), "archive_info": {"hashes": {"sha256": "0" * 64}}},
            f"pip install '{wheel}[lightning]'",
        ),
        (
            {
                "url": "https://github.com/someone/bnswap.git",
                "vcs_info": {"vcs": "git", "requested_revision": "main", "commit_id": "7f3e1a2"},
            },
            "pip install 'bnswap[lightning] @ git+https://github.com/someone/bnswap.git@7f3e1a2'",
        ),
        (
            {"url": "https://example.org/bnswap-0.1.0.tar.gz", "archive_info": {}},
            "pip install 'bnswap[lightning] @ https://example.org/bnswap-0.1.0.tar.gz'",
        ),
        (None, "pip install 'bnswap[lightning]'"),  # an index that has it: no direct_url
        ({"url": (tmp_path / "gone").as_uri(), "dir_info": {}}, None),  # moved or deleted
    ]
    for info, want in cases:
        assert extras.command_for("lightning", info) == want, info
    assert extras.command_for("lightning", None, installed=False) is None
    # code run from a checkout (on sys.path): that folder, -e when installed editable there
    assert extras.command_for("onnx", None, installed=False, checkout=str(checkout)) == (
        f"pip install '{checkout}[onnx]'"
    )
    assert (
        extras.command_for(
            "onnx", {"url": url, "dir_info": {"editable": True}}, checkout=str(checkout)
        )
        == f"pip install -e '{checkout}[onnx]'"
    )


def test_the_hint_of_this_checkout():
    """From this checkout: its folder (the suite runs the checkout's code). (Nothing known,
    the extra by name and the README's Install section: tests/test_install.py.)"""
    assert extras.install_hint("lightning") == (
        f"pip install '{ROOT}[lightning]' (bnswap's 'lightning' extra)"
    )
    with pytest.raises(ValueError, match="unknown extra 'cuda'; bnswap's extras are lightning"):
        extras.install_hint("cuda")


def test_every_extra_is_one_of_pyproject(tmp_path):
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(extras.EXTRAS) == set(project["optional-dependencies"])

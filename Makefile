# bnswap: one-command setup, main job and tests. Each target creates its virtual
# environment on first use. torch is always installed FIRST and pinned, so pip never
# resolves a newer (multi-GB CUDA) build.
#   make demo   - set up .venv with what the demo needs (torch, then bnswap[lightning])
#                 and train the MobileNetV2-style net on the digits data
#   make lint   - ruff (lint and format check) over the tree, mypy over the package, and a
#                 user's mypy --strict through bnswap (tests/user_types.py), in .venv with
#                 the demo's packages and the lint tools only (the lint and onnx extras)
#   make test   - lint, then set up .venv (the demo's packages, then every extra and
#                 tool the suite uses) and .venv-zoo, and run the whole suite in both
#                 (in .venv it builds the docs site too: tests/test_site.py)
#   make docs   - build the docs site into build/docs/html (warnings are errors) and run
#                 the docstrings' examples (tests/test_docs.py), in .venv with the demo's
#                 packages and the docs extra only
#   make dist   - build the sdist and the wheel into dist/ and check them (twine --strict)
#   make compat - the core suite on each torch release of COMPAT_TORCH, one venv each
#                 (.venv-compat-<release>); slow (3-4 GB per release), not part of test
PYTHON ?= python3
VENV ?= .venv
ZOO ?= .venv-zoo
# The CPU build of torch 2.13: from the machine's own wheels or index when it has it,
# else from PyTorch's CPU index (PyPI's torch==2.13.0 is a CUDA build that pulls several
# GB of NVIDIA packages). The zoo pins torch 2.14.1 as the project's CI machine holds it
# (a CUDA build that runs on the CPU, ~6 GB); see the README for the CPU builds.
TORCH ?= torch==2.13.0+cpu
ZOO_TORCH ?= torch==2.14.1 torchvision==0.29.1
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PIP := -m pip install -q --disable-pip-version-check
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/build/inductor-cache
export MPLBACKEND ?= Agg

.PHONY: setup setup-demo setup-lint setup-docs setup-zoo demo lint test test-main test-zoo docs docs-html dist compat bench mutation clean FORCE

# .venv holds bnswap as an editable install in setuptools' strict mode: a tree of links to
# the package's files (build/__editable__.bnswap-*) on a plain .pth path, which type
# checkers follow. The default mode's import hook is code that mypy and pyright never run:
# a user's `mypy --strict` saw bnswap as Any (issue 46). Edits show at once, as in any
# editable install; a file added to or removed from the package needs the links made
# again, which $(VENV)/.linked does whenever the list of the package's files (or the link
# tree itself) changed.
EDITABLE := --config-settings editable_mode=strict
LIST_PACKAGE_FILES = { find bnswap -name __pycache__ -prune -o -type f \( -name '*.py' \
	-o -name py.typed -o -name '*.yaml' \) -print; ls -d build/__editable__.bnswap-* \
	2>/dev/null || true; } | LC_ALL=C sort

# After torch, every install runs with a constraints file pinning it, so no package's
# own torch requirement can make pip fetch another build.
# transformers + accelerate (the Hugging Face Trainer recipe, tests/test_recipes.py) go
# into .venv only: its CPU torch makes them cheap; the zoo skips that test.
# Stamps in one venv: .demo-installed (torch, then bnswap with the lightning extra:
# Lightning, scikit-learn's digits, matplotlib; all `make demo` runs), and on it
# .lint-installed (the lint tools, and the onnx extra whose types mypy reads),
# .docs-installed (Sphinx and its theme, myst-parser, pytest) and .installed (the rest the
# suite uses: ONNX Runtime, onnx, the dev and docs tools, the recipes' packages, ONNX
# Runtime's C++ extension), so each target installs what it needs, each package once.
$(VENV)/.demo-installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python $(PIP) --upgrade pip
	$(VENV)/bin/python $(PIP) $(TORCH) 2>/dev/null || \
		$(VENV)/bin/python $(PIP) --extra-index-url $(TORCH_INDEX) $(TORCH)
	echo '$(TORCH)' > $(VENV)/constraints.txt
	$(VENV)/bin/python $(PIP) -c $(VENV)/constraints.txt -e '.[lightning]' $(EDITABLE)
	touch $@

$(VENV)/.lint-installed: $(VENV)/.demo-installed
	$(VENV)/bin/python $(PIP) -c $(VENV)/constraints.txt -e '.[lightning,onnx,lint]' $(EDITABLE)
	touch $@

$(VENV)/.docs-installed: $(VENV)/.demo-installed
	$(VENV)/bin/python $(PIP) -c $(VENV)/constraints.txt -e '.[lightning,docs]' $(EDITABLE)
	touch $@

$(VENV)/.installed: $(VENV)/.demo-installed
	$(VENV)/bin/python $(PIP) -c $(VENV)/constraints.txt -e '.[lightning,ort-cpu,onnx,dev,docs]' \
		$(EDITABLE) transformers==5.23.0 accelerate==1.16.0
	$(VENV)/bin/python $(PIP) --no-deps torch-ort==1.19.2
	$(VENV)/bin/python -m bnswap.ort build
	touch $@

# The package's files, and the link tree: rewritten only when they changed (so .linked,
# which makes the links again, runs only then).
$(VENV)/.package-files: FORCE
	@mkdir -p $(VENV)
	@$(LIST_PACKAGE_FILES) > $@.new
	@if cmp -s $@.new $@; then rm -f $@.new; else mv -f $@.new $@; fi

$(VENV)/.linked: $(VENV)/.demo-installed $(VENV)/.package-files
	$(VENV)/bin/python $(PIP) --no-deps -e . $(EDITABLE)
	@$(LIST_PACKAGE_FILES) > $(VENV)/.package-files
	touch $@

FORCE:

$(ZOO)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(ZOO)
	$(ZOO)/bin/python $(PIP) --upgrade pip
	$(ZOO)/bin/python $(PIP) $(ZOO_TORCH)
	printf '%s\n' $(ZOO_TORCH) > $(ZOO)/constraints.txt
	$(ZOO)/bin/python $(PIP) -c $(ZOO)/constraints.txt -e '.[lightning,dev]' timm==1.0.31 ultralytics==8.4.190
	touch $@

setup: $(VENV)/.installed $(VENV)/.linked
setup-demo: $(VENV)/.demo-installed $(VENV)/.linked
setup-lint: $(VENV)/.lint-installed $(VENV)/.linked
setup-docs: $(VENV)/.docs-installed $(VENV)/.linked
setup-zoo: $(ZOO)/.installed

demo: setup-demo
	$(VENV)/bin/bnswap train --config configs/digits_mobilenetv2.yaml

# -rs: the closing lines list every skipped test with its reason
test-main: setup
	$(VENV)/bin/python -m pytest -q -rs -p no:cacheprovider tests

test-zoo: setup-zoo
	$(ZOO)/bin/python -m pytest -q -rs -p no:cacheprovider tests

# The site: Sphinx over docs/ (nitpicky: every reference must resolve), warnings are errors.
# The docstrings' examples run once, in tests/test_docs.py (make test runs it and, through
# tests/test_site.py, this build).
docs-html: setup-docs
	$(VENV)/bin/python -m sphinx -b html -n -W --keep-going -q docs build/docs/html

docs: docs-html
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_docs.py

dist: setup
	rm -rf dist
	$(VENV)/bin/python -m build --no-isolation --outdir dist .
	$(VENV)/bin/python -m twine check --strict dist/*

# Lint and types (docs/development.md, "Checks"; configured in pyproject.toml). mypy
# keeps its cache in .mypy_cache (the user's check in build/mypy-user): a rerun after a
# small change takes seconds.
lint: setup-lint
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy bnswap
	$(VENV)/bin/python tests/user_types.py

test: lint test-main test-zoo

# The oldest torch bnswap supports (pyproject.toml's floor), one between, the newest.
# Each venv: torch from PyPI first, then bnswap's core dependencies and the test tools,
# every pip call under a constraints file pinning that torch (PIP_CONSTRAINT, which also
# takes the place of a machine-wide pip constraint). Results: benchmarks/results/compat.md.
COMPAT_TORCH ?= 2.4.1 2.9.1 2.15.0
COMPAT_DEPS ?= 'pytest>=8' 'hypothesis>=6.100' 'pytest-timeout>=2.3' numpy
COMPAT_TESTS ?= tests/test_layers.py tests/test_convert.py tests/test_bad_inputs.py \
	tests/test_atomic.py tests/test_registry.py tests/test_graphs.py tests/test_gradcheck.py \
	tests/test_checkpoints.py tests/test_kernel_selection.py tests/test_kernel_rule.py \
	tests/test_isinstance_functions.py tests/test_patches.py tests/test_after_training.py \
	tests/test_backends.py

.venv-compat-%/.installed: pyproject.toml
	$(PYTHON) -m venv .venv-compat-$*
	echo 'torch==$*' > .venv-compat-$*/constraints.txt
	export PIP_CONSTRAINT=$(CURDIR)/.venv-compat-$*/constraints.txt && \
	.venv-compat-$*/bin/python $(PIP) --upgrade pip && \
	.venv-compat-$*/bin/python $(PIP) torch==$* && \
	.venv-compat-$*/bin/python $(PIP) -e . $(COMPAT_DEPS)
	touch $@

compat: $(foreach v,$(COMPAT_TORCH),.venv-compat-$(v)/.installed)
	mkdir -p build/compat
	for v in $(COMPAT_TORCH); do \
		rm -f build/compat/$$v.xml; \
		TORCHINDUCTOR_CACHE_DIR=$(CURDIR)/build/compat/inductor-$$v PYTHONPATH=$(CURDIR) \
		.venv-compat-$$v/bin/python -m pytest -q -p no:cacheprovider -rfEs \
			--junitxml=build/compat/$$v.xml $(COMPAT_TESTS); \
	done; \
	$(PYTHON) benchmarks/compat.py $(foreach v,$(COMPAT_TORCH),build/compat/$(v).xml)

bench: setup
	$(VENV)/bin/python -m benchmarks

# Mutation testing (docs/reliability.md; not in CI, ~20 min on 2 cores): mutmut over
# the modules where a wrong number is silent, configured in pyproject.toml. A fresh
# run (rm -rf mutants) after tests changed: mutmut maps mutants to tests once.
mutation: setup
	$(VENV)/bin/python $(PIP) -c $(VENV)/constraints.txt mutmut==3.8.1
	rm -rf mutants
	$(VENV)/bin/mutmut run --max-children 2
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) $(ZOO) build mutants

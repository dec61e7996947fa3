# `make synth` and `make test` set up .venv on first use. Each set-up step leaves a stamp file in
# .venv and is redone only when pyproject.toml changes or .venv is removed, so later runs start at once.
PYTHON ?= python3
VENV := .venv
VENV_PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed.stamp
REFERENCE_INSTALLED := $(VENV)/.reference-installed.stamp

.PHONY: synth test

synth: $(INSTALLED)
	$(VENV)/bin/tts synth examples/corpus.txt --out out/example

# Two workers, tests handed out as they free up (the two Triton-interpreter checks take ~3 min each).
test: $(INSTALLED) $(REFERENCE_INSTALLED) espeak-ng chromium
	$(VENV_PYTHON) -m pytest -q -n 2 --dist worksteal

# The WER acceptance test speaks with espeak-ng (a Debian package). Installed when missing and we
# are root with apt-get; otherwise that test skips and says why.
.PHONY: espeak-ng
espeak-ng:
	@command -v espeak-ng >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng >/dev/null \
		     || echo "make: could not install espeak-ng: the WER acceptance test will skip"; } \
		|| echo "make: espeak-ng missing and apt-get unusable (not root?): the WER acceptance test will skip"; }

# The report.html test drives Debian's chromium through Playwright (pip `playwright`, in the extra
# [test]; Playwright's own browser download is not used). Installed when missing and we are root with
# apt-get; otherwise that test skips and says why.
.PHONY: chromium
chromium:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
		     || echo "make: could not install chromium: the report.html browser test will skip"; } \
		|| echo "make: chromium missing and apt-get unusable (not root?): the report.html browser test will skip"; }

$(VENV_PYTHON):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned: 2.13.0 is a CPU wheel on local disk here, while an unpinned torch
# requirement would pull a multi-GB CUDA build.
$(INSTALLED): pyproject.toml | $(VENV_PYTHON)
	$(VENV_PYTHON) -m pip install torch==2.13.0
	$(VENV_PYTHON) -m pip install -e '.[test,wer,ray]'
	touch $@

# The official implementation, for the test that compares against it live. Its code breaks on
# transformers after 5.17; --no-deps because it declares torchaudio (which brings another torch),
# gradio, librosa and more, none of which running its model needs.
$(REFERENCE_INSTALLED): $(INSTALLED)
	$(VENV_PYTHON) -m pip install transformers==5.17.0
	$(VENV_PYTHON) -m pip install --no-deps qwen-tts-hf==0.1.1.post1 einops accelerate==1.12.0
	touch $@

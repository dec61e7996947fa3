"""tts: offline batch text-to-speech for Qwen3-TTS 12 Hz checkpoints (CustomVoice, Base, VoiceDesign)."""

__version__ = "0.1.0"
INTERRUPTED_EXIT = 130  # the shell convention for a command stopped by Ctrl-C (128 + SIGINT)


def install_hint(extra: str) -> str:
    """How to install an optional extra: from the checkout (`pip install 'tts[...]'` would fetch PyPI's
    `tts`, another project)."""
    return f"pip install -e '.[{extra}]' in the tts checkout"

"""tts: offline batch text-to-speech for Qwen3-TTS 12 Hz CustomVoice checkpoints."""

__version__ = "0.1.0"

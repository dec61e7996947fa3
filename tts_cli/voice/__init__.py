"""Voice cloning inputs: reference audio files (reference_audio.py), the row checks of the voice
fields (checks.py) and the per-folder cache of encoded references (cache.py)."""

"""What a reference file must be (why: tts_cli/voice/reference_audio.py); plain constants, so that
`tts --help` can state them without importing numpy."""
SAMPLE_RATE = 24_000          # the speaker encoder's and the 12 Hz tokenizer's input rate
MIN_SECONDS = 1.0
MAX_SECONDS = 60.0
MIN_SOURCE_RATE = 8_000
SILENCE_DBFS = -60.0
LIMITS_HELP = (f"A reference must be {MIN_SECONDS:g} to {MAX_SECONDS:g} s of audio (the official code sets no "
               f"maximum; {MAX_SECONDS:g} s keeps an ICL prompt, 12.5 talker positions per reference second, "
               f"small), not silent (RMS above {SILENCE_DBFS:g} dBFS), sampled at {MIN_SOURCE_RATE} Hz or more, "
               "without NaN or infinite samples; a bad one fails the rows that use it (a bad --ref-audio stops the run "
               "before the model loads).")

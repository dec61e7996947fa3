"""What a run leaves on disk: one WAV per row and the run's reports."""

import torch

# The tiny test models gain nothing from several threads, and on a busy 2-core machine OpenMP
# threads that wait for each other make every small op ~30x slower. One thread also fixes the
# reduction order (the golden records were made with one thread too).
torch.set_num_threads(1)


import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "wer: keep WER on in `tts synth` (the default outside tests)")


@pytest.fixture(autouse=True)
def _synth_without_wer_unless_marked(request, monkeypatch):
    """`tts synth` computes WER by default when the extra [wer] is installed, which starts an ASR
    worker process per run (seconds each). The tests of the pipeline run without it, as with
    --no-wer; the tests marked `wer` keep the default."""
    if request.node.get_closest_marker("wer") is None:
        from tts_cli import cli
        monkeypatch.setattr(cli, "resolve_synth_asr", lambda option, required=False: None)

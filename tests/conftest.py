import torch

# The tiny test models gain nothing from several threads, and on a busy 2-core machine OpenMP
# threads that wait for each other make every small op ~30x slower. One thread also fixes the
# reduction order (the golden records were made with one thread too).
torch.set_num_threads(1)


import subprocess  # noqa: E402

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


@pytest.fixture
def mount_tmpfs(tmp_path):
    """mount_tmpfs(name, options): a tmpfs mounted at tmp_path / name with mount's -o options (e.g. "size=64k,ro";
    the tests run as root where they can mount one, and root writes into any folder only chmod'ed read-only), the
    test skipped where it cannot be mounted; unmounted after the test."""
    mounted = []

    def mount(name: str, options: str):
        folder = tmp_path / name
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=True)

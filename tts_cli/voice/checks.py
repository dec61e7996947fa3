"""Row-level checks of a request's voice fields: those the manifest can make alone
(`voice_fields_problem`) and the one that needs the checkpoint's type (`clone_problem`)."""
from __future__ import annotations

from ..request import Request

# The checkpoint type (config.json `tts_model_type`) whose checkpoints ship `speaker_encoder.*`
# and the speech tokenizer's encoder: the only one that can clone a voice.
CLONING_MODEL_TYPE = "base"


def voice_fields_problem(request: Request) -> str | None:
    """Why the row's ref_audio / ref_text / x_vector_only / instruct do not go together, or None."""
    if not request.clones_voice:
        if request.ref_text:
            return "ref_text without ref_audio: a transcript is only used with a reference to clone"
        if request.x_vector_only:
            return "x_vector_only without ref_audio: there is no reference to take a speaker embedding from"
        return None
    if not request.x_vector_only and not request.ref_text:
        return ("ICL voice cloning (x_vector_only false) needs ref_text, the reference's transcript; "
                "give it, or set x_vector_only to clone from the speaker embedding alone")
    if request.instruct:
        return "instruct with ref_audio: a voice clone takes no instruct (the official generate_voice_clone has none)"
    return None


def clone_problem(request: Request, tts_model_type: str) -> str | None:
    """Why a checkpoint of this type cannot synthesize the row's voice, or None. For the model side."""
    if request.clones_voice and tts_model_type != CLONING_MODEL_TYPE:
        return (f"this checkpoint ({tts_model_type}) cannot clone a voice: needs a Base checkpoint "
                "(Qwen3-TTS-12Hz-1.7B-Base or -0.6B-Base), the only ones with a speaker encoder")
    return None

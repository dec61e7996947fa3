"""Row-level checks of a request's voice fields: those the manifest can make alone
(`voice_fields_problem`) and the one that needs the checkpoint's type (`clone_problem`); and the
check of the voice options, the voice of every row that names none, before the model loads
(`check_voice_options`: `tts synth` and the Ray path both run it, so that both refuse the same values)."""
from __future__ import annotations

import re
from collections.abc import Callable

from ..errors import RequestError, TTSError
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


def check_voice_options(cfg, speaker: str | None, language: str, instruct: str | None,
                        ref_audio: str | None, ref_text: str | None, x_vector_only: bool,
                        given_by: Callable[[str], str], max_text_chars: int) -> None:
    """The voice options (the voice of every row that names none) against the checkpoint, before it
    loads: a value its rows cannot take would fail each of them once the model has loaded.
    speaker None: not given. given_by(option): where its value came from, for the message (the
    row-level messages name the manifest's columns: given as options, the options' names)."""
    from ..checkpoint import BASE, CUSTOM_VOICE
    from ..manifest import MAX_INSTRUCT_CHARS, default_reference_path, text_problem
    from ..model.prompt import resolve_language_id
    from ..synthesizer import check_no_added_tokens, check_voice
    from .reference_audio import check_reference, reference_value_problem

    option = "speaker"
    try:
        if speaker is not None:
            check_voice(cfg, speaker, None, False)
        option = "language"
        resolve_language_id(cfg, speaker if cfg.model_type == CUSTOM_VOICE else None, language)
        option = "instruct"
        instruct = instruct and instruct.strip()   # (as the manifest reads it: whitespace alone is none)
        if instruct and cfg.model_type == BASE:
            check_voice(cfg, None, instruct, False)
        too_long = instruct and text_problem(instruct, MAX_INSTRUCT_CHARS, "instructs")
        if too_long:
            raise RequestError(too_long)
        if cfg.supports_instruct:   # (a CustomVoice 0.6B's rows leave it out, with a note)
            check_no_added_tokens(cfg, Request(id="", text="", instruct=instruct))
        ref_text = ref_text and ref_text.strip()   # (as the manifest reads it)
        reference_path = default_reference_path(ref_audio)
        if reference_path is None:
            for option, value, what in (("ref_text", ref_text, "the transcript of that file"),
                                        ("x_vector_only", x_vector_only, "how to clone that file")):
                if value:
                    raise TTSError(f"{given_by(option)}: given without {given_by('ref_audio')}, whose option it is "
                                   f"({what}); a manifest row with a reference of its own takes its own {option} "
                                   "column")
            return
        option = "ref_text"
        bad_text = ref_text and text_problem(ref_text, max_text_chars)
        if bad_text:
            raise RequestError(bad_text)
        check_no_added_tokens(cfg, Request(id="", text="", ref_text=ref_text))
        option = "ref_audio"
        request = Request(id="", text="", instruct=instruct, ref_audio=ref_audio, ref_text=ref_text or None,
                          x_vector_only=x_vector_only)
        problem = (_as_options(clone_problem(request, cfg.model_type), given_by) or reference_value_problem(ref_audio)
                   or _as_options(voice_fields_problem(request), given_by))
        if problem:
            raise RequestError(problem)
        check_reference(reference_path)
    except RequestError as e:
        message = str(e).removeprefix(option + ": ")
        if option in ("ref_audio", "ref_text", "instruct"):   # "ref_audio 'x' is a URL" -> "--ref-audio: 'x' is a URL"
            message = message.removeprefix(option + " ")
        raise TTSError(f"{given_by(option)}: {message}") from None


def _as_options(problem: str | None, given_by: Callable[[str], str]) -> str | None:
    """A row-level voice problem, which names the manifest's columns, naming the options instead where
    the values came from options (not from a recipe, whose keys are the columns' names)."""
    if not problem or not given_by("ref_audio").startswith("--"):
        return problem
    problem = problem.replace("(x_vector_only false)", "(without --x-vector-only)")
    for column in ("x_vector_only", "ref_text", "ref_audio"):
        problem = re.sub(rf"\b{column}\b", given_by(column), problem)
    return problem

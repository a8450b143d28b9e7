"""Which stage processes a server of several models runs: a talker per model, and one code2wav for every model whose
speech decoder is the same (its weights' content hash, `decoder_fingerprint`, compared at start-up), else one per
distinct decoder. One model is today's pipeline: stages `talker` and `code2wav`. With several, the first model's
stages keep those names and the others' are `<kind>:<model name>` (`talker:base`; stages.messages.stage_kind)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from omni_tts.models.qwen3_tts.model import decoder_fingerprint


@dataclass(frozen=True)
class ServedCheckpoint:
    """One model of the server: its name (the primary served name) and its checkpoint directory."""
    name: str
    model_dir: str


@dataclass(frozen=True)
class PipelineLayout:
    talkers: dict[str, str]        # talker stage → the model directory it loads
    decoders: dict[str, str]       # code2wav stage → the model directory whose decoder it loads
    decoder_of: dict[str, str]     # talker stage → the code2wav stage that decodes its codes
    talker_of: dict[str, str]      # model name → its talker stage

    def readers_of(self, code2wav: str) -> list[str]:
        """The talker stages whose connectors `code2wav` reads, in model order."""
        return [talker for talker, decoder in self.decoder_of.items() if decoder == code2wav]


def plan_layout(models: Sequence[ServedCheckpoint]) -> PipelineLayout:
    """The stages for `models` (the first is the server's default); ValueError for a name given twice."""
    names = [model.name for model in models]
    if not models or len(set(names)) != len(names):
        raise ValueError(f"every model needs a name of its own, got {names}")
    if len(models) == 1:
        only = models[0]
        return PipelineLayout({"talker": only.model_dir}, {"code2wav": only.model_dir}, {"talker": "code2wav"},
                              {only.name: "talker"})
    talkers, decoders, decoder_of, talker_of = {}, {}, {}, {}
    by_fingerprint: dict[str, str] = {}   # decoder hash → its code2wav stage
    for index, model in enumerate(models):
        talker = "talker" if index == 0 else f"talker:{model.name}"
        fingerprint = decoder_fingerprint(model.model_dir)
        if fingerprint not in by_fingerprint:
            code2wav = "code2wav" if not decoders else f"code2wav:{model.name}"
            by_fingerprint[fingerprint], decoders[code2wav] = code2wav, model.model_dir
        talkers[talker], talker_of[model.name] = model.model_dir, talker
        decoder_of[talker] = by_fingerprint[fingerprint]
    return PipelineLayout(talkers, decoders, decoder_of, talker_of)

"""What a request may ask of sampling, each field once with its range, and how it resolves; torch-free, so the stage
config and the CLI can import it.

`SamplingParams` states the fields and their bounds (msgspec Meta) once: the HTTP request schema inherits it
(entrypoints/api/schema.py), the stage YAML's `sampling:` defaults are `SamplingDefaults` (config/stage_config.py, which
checks them at start-up), and `validate` checks the same bounds for a request built in Python. Resolution order:
the request, then the server's defaults, then the checkpoint's generation_config.json, then the reference wrapper's
fallbacks.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_type_hints

import msgspec

# wrapper fallbacks (reference `Qwen3TTSModel`), used when generation_config.json lacks a key
FALLBACK_GENERATION = dict(do_sample=True, temperature=0.9, top_k=50, top_p=1.0, repetition_penalty=1.05,
                           subtalker_dosample=True, subtalker_temperature=0.9, subtalker_top_k=50,
                           subtalker_top_p=1.0, max_new_tokens=2048)
MIN_NEW_TOKENS = 2           # the talker never ends before this many tokens (EOS is masked until then)
MAX_NEW_TOKENS = 8192
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 2 ** 31 - 1      # beyond the vocab means "no top-k"; bounded so it fits every integer type on its way
MAX_SEED = 2 ** 63 - 1       # the noise hash takes an int64 seed

Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_TEMPERATURE)]  # 0 = greedy
TopK = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOP_K)]  # 0 disables
Probability = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
RepetitionPenalty = Annotated[float, msgspec.Meta(gt=0.0, le=MAX_REPETITION_PENALTY)]
NewTokens = Annotated[int, msgspec.Meta(ge=MIN_NEW_TOKENS, le=MAX_NEW_TOKENS)]
Seed = Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)]


class SamplingError(ValueError):
    """A sampling value out of its range; `param` is the field's name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class SamplingDefaults(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The sampling fields a server may default (the stage YAML's `sampling:`): every request field but the seed.
    None = the next source in the resolution order."""
    temperature: Temperature | None = None
    top_k: TopK | None = None
    top_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    subtalker_temperature: Temperature | None = None
    subtalker_top_k: TopK | None = None
    subtalker_top_p: Probability | None = None
    max_new_tokens: NewTokens | None = None


class SamplingParams(SamplingDefaults, kw_only=True, forbid_unknown_fields=True):
    """What a request asks for. temperature 0 means greedy for the talker and, unless subtalker_temperature is set,
    for the code predictor."""
    seed: Seed | None = None

    @classmethod
    def of(cls, source: object) -> SamplingParams:
        """The sampling fields of any object that has them (an HTTP request, parsed CLI arguments); absent = None."""
        return cls(**{name: getattr(source, name, None) for name in cls.__struct_fields__})

    def validate(self) -> None:
        """SamplingError naming the field for a value out of its range (NaN included); the bounds are the fields'
        annotations, the ones the HTTP schema and the stage YAML enforce."""
        for name in self.__struct_fields__:
            value = getattr(self, name)
            try:
                msgspec.convert(value, _FIELD_TYPES[name])
            except msgspec.ValidationError:
                raise SamplingError(name, f"{name} must be {value_range(name)}, got {value!r}") from None


_FIELD_TYPES = get_type_hints(SamplingParams, include_extras=True)


def value_range(name: str) -> str:
    """A field's range as a person reads it, from its annotation: `in [0, 100]`, `in (0, 1]`, `an integer in ...`."""
    meta = next(m for arg in get_args(_FIELD_TYPES[name]) for m in get_args(arg)[1:] if isinstance(m, msgspec.Meta))
    kind = next(get_args(arg)[0] for arg in get_args(_FIELD_TYPES[name]) if get_args(arg))
    def bound(value: float) -> str:
        return f"{value:g}" if isinstance(value, float) else str(value)
    low = f"[{bound(meta.ge)}" if meta.ge is not None else f"({bound(meta.gt)}"
    high = f"{bound(meta.le)}]" if meta.le is not None else f"{bound(meta.lt)})"
    return f"{'an integer' if kind is int else 'a number'} in {low}, {high}"


@dataclass(frozen=True)
class ResolvedSampling:
    """Concrete per-request values; temperature 0 = greedy."""
    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    subtalker_temperature: float
    subtalker_top_k: int
    subtalker_top_p: float
    max_new_tokens: int
    seed: int


def resolve_sampling(params: SamplingParams, generation_config: dict[str, Any],
                     defaults: SamplingDefaults | None = None) -> ResolvedSampling:
    """The request's values, else the server's `defaults`, else the checkpoint's, else the fallbacks; SamplingError
    for a request value out of range."""
    if defaults is not None:
        params = SamplingParams(**{name: getattr(defaults, name) if getattr(params, name) is None
                                   else getattr(params, name) for name in SamplingDefaults.__struct_fields__},
                                seed=params.seed)
    params.validate()
    checkpoint = {k: generation_config.get(k, v) for k, v in FALLBACK_GENERATION.items()}

    def pick(name: str) -> Any:
        value = getattr(params, name)
        return checkpoint[name] if value is None else value

    temperature = pick("temperature") if checkpoint["do_sample"] or params.temperature is not None else 0.0
    if params.subtalker_temperature is not None:
        sub_temperature = params.subtalker_temperature
    elif params.temperature == 0 or not checkpoint["subtalker_dosample"]:
        sub_temperature = 0.0
    else:
        sub_temperature = checkpoint["subtalker_temperature"]
    return ResolvedSampling(temperature=float(temperature), top_k=int(pick("top_k")), top_p=float(pick("top_p")),
                            repetition_penalty=float(pick("repetition_penalty")),
                            subtalker_temperature=float(sub_temperature), subtalker_top_k=int(pick("subtalker_top_k")),
                            subtalker_top_p=float(pick("subtalker_top_p")), max_new_tokens=int(pick("max_new_tokens")),
                            seed=secrets.randbits(63) if params.seed is None else int(params.seed))

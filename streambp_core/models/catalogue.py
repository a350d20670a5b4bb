"""The model catalogue: a model's name found (`model_file`: the one place a name is matched to a shipped
preset and a config.json is read), and the path that serves its family. Neither imports torch or
transformers, so a command refuses a name or a family before either is imported.

A name is a preset's (case-insensitive, surrounding spaces ignored: `find_preset`) or a local directory
(or file) with config.json; `model_file` reads it once, and whoever needs its values (the cheap checks,
`models.load_config`, `models.load_model`, `models.tiny_config`) takes them from what it returns.

The path that serves a family is one of three tiers:

1. `engine`: a family of `families.FAMILIES` (or a multimodal wrapper of one, `families.TEXT_WRAPPERS`):
   every method; streambp through the engine's own layer math.
2. `baselines`: any other decoder-only text family whose `*ForCausalLM` transformers builds (its causal-LM
   map): plain and checkpoint, which are transformers' own forward and its own activation checkpointing,
   and mst where its chunked MLP and head apply (`models.generic.mst_pieces`, decided on the built model);
   streambp through the model's own decoder layers (`methods.own_stream`, on cpu and cuda, and simulated
   under the engine's attention), refused by name where a layer does what that path cannot carry.
3. `refused`, by name: what is not a decoder-only text causal LM: a multimodal model, an encoder-decoder,
   a bidirectional encoder, a model_type outside transformers' causal-LM map.

A family of the second tier may still be refused when its step cannot run (an op without a meta kernel):
that refusal names the op (`models.generic.step_failure`).

The maps are read from transformers' `models/auto/modeling_auto.py` (the `OrderedDict([...])` literals of
`MODEL_FOR_*_MAPPING_NAMES`); where a release spells them otherwise they are imported instead.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from streambp_core.config import PRESET_DIR, ConfigError, preset_names
from streambp_core.models.families import SUPPORTED_FAMILIES, TEXT_WRAPPERS

CAUSAL_LM = "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"
MULTIMODAL = ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",)
ENCODER_DECODER = ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES")
ENCODER = ("MODEL_FOR_MASKED_LM_MAPPING_NAMES",)


@dataclass(frozen=True)
class ModelFile:
    """A model name found in the catalogue and its config.json, read once (`model_file`)."""

    preset: str | None
    """The shipped preset the name matched; None for a local directory or file."""
    path: Path
    """The preset's file, or the directory (or file) the name gave."""
    file: Path
    """The config.json read."""
    values: dict = field(compare=False, repr=False)
    """Its JSON object, as read: copy before changing it."""

    @property
    def source(self) -> str:
        """How an error names the model: the preset's name, or the path given."""
        return self.preset or str(self.path)


def find_preset(name: str) -> str | None:
    """The shipped preset `name` names (case-insensitive, surrounding spaces ignored), or None."""
    wanted = name.strip().lower()
    return next((preset for preset in preset_names() if preset.lower() == wanted), None)


def preset_file(preset: str) -> Path:
    """The config.json of the shipped preset `preset`: `<org>--<name>.json` for `<org>/<name>`."""
    return PRESET_DIR / f"{preset.replace('/', '--')}.json"


def model_file(name: str) -> ModelFile:
    """The model `name` names, its config.json read: a shipped preset (`find_preset`), else a local
    directory with config.json (or the file itself). ConfigError (one line) for a name that is neither
    (listing the presets), a directory without config.json, or a file that is not a JSON object."""
    preset = find_preset(name)
    if preset is not None:
        file = preset_file(preset)
        return ModelFile(preset, file, file, read_config_file(file))
    path = Path(name).expanduser()
    if not path.exists():
        raise ConfigError(f"unknown model {name!r}: not a preset nor a local directory with config.json; "
                          f"presets: {', '.join(preset_names())}")
    file = path if path.is_file() else path / "config.json"
    if not file.is_file():
        raise ConfigError(f"{path} has no config.json")
    return ModelFile(None, path, file, read_config_file(file))


def read_config_file(path: Path) -> dict:
    """The JSON object in `path`, or ConfigError naming the file and what is wrong with it."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (config.json must be JSON)") from None
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror or error}") from None
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno}, column {error.colno}"
        raise ConfigError(f"{path}: not valid JSON ({error.msg} at {where})") from None
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a JSON object, got a JSON {_json_kind(values)}")
    return values


def _json_kind(value: object) -> str:
    kinds = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    return kinds.get(type(value), "null")


@dataclass(frozen=True)
class Serving:
    """The path that serves one `model_type`."""

    model_type: str
    path: str
    """"engine", "baselines" or "refused"."""
    reason: str = ""
    """Why a refused family is refused (one clause); empty otherwise."""

    @property
    def label(self) -> str:
        """The path in words, as `presets --families` and docs/models.md list it."""
        if self.path == "engine":
            return "engine (every method)"
        if self.path == "baselines":
            return ("baselines (plain, checkpoint; streambp through its own layers; mst where its MLP is "
                    "token-wise)")
        return f"refused: {self.reason}"


@cache
def auto_map(name: str) -> dict[str, str]:
    """transformers' `modeling_auto.<name>` (model_type -> class name), read from its source (transformers
    is not imported), or imported where the source spells it otherwise; empty when it has none."""
    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.origin is not None:
        found = _read_map(Path(spec.origin).parent / "models" / "auto" / "modeling_auto.py", name)
        if found is not None:
            return found
    from transformers.models.auto import modeling_auto

    return dict(getattr(modeling_auto, name, {}))


def _read_map(file: Path, name: str) -> dict[str, str] | None:
    """The (str, str) pairs of `name = OrderedDict([...])` in `file`, or None."""
    try:
        tree = _parsed(file)
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name) and node.targets[0].id == name):
            continue
        call = node.value
        if isinstance(call, ast.Call) and call.args and isinstance(call.args[0], ast.List):
            pairs = [tuple(item.value for item in element.elts) for element in call.args[0].elts
                     if isinstance(element, ast.Tuple) and len(element.elts) == 2
                     and all(isinstance(item, ast.Constant) for item in element.elts)]
            return {key: value for key, value in pairs if isinstance(key, str) and isinstance(value, str)}
    return None


@cache
def _parsed(file: Path) -> ast.Module:
    return ast.parse(file.read_text(encoding="utf-8"))


def _in_any(model_type: str, names: tuple[str, ...]) -> bool:
    return any(model_type in auto_map(name) for name in names)


def serving(model_type: str) -> Serving:
    """The tier of `model_type` (module docstring), from its name and transformers' maps alone."""
    if model_type in SUPPORTED_FAMILIES or model_type in dict(TEXT_WRAPPERS):
        return Serving(model_type, "engine")
    causal = auto_map(CAUSAL_LM)
    if model_type not in causal:
        why = "transformers has no causal LM of it (not in its causal-LM map)"
        return Serving(model_type, "refused", why)
    model_class = causal[model_type]
    if model_class.endswith("ForConditionalGeneration") or _in_any(model_type, MULTIMODAL):
        return Serving(model_type, "refused", f"a multimodal model ({model_class}); give its text model's "
                                              "config")
    if _in_any(model_type, ENCODER_DECODER):
        return Serving(model_type, "refused", f"an encoder-decoder ({model_class} is the decoder of one)")
    if _in_any(model_type, ENCODER):
        return Serving(model_type, "refused", f"a bidirectional encoder ({model_class} is causal only as "
                                              "the decoder of an encoder-decoder)")
    return Serving(model_type, "baselines")


def accepted() -> str:
    """What each method accepts, in one clause (the tail of every refusal of a family)."""
    wrappers = ", ".join(wrapper for wrapper, _ in TEXT_WRAPPERS)
    return ("plain and checkpoint run any decoder-only text *ForCausalLM transformers builds; mst those "
            f"whose layers have a token-wise MLP; streambp those through their own decoder layers, and the "
            f"engine's layer math for the engine families ({', '.join(SUPPORTED_FAMILIES)}) "
            f"and the multimodal wrappers {wrappers} as their text models")


def refusal(model_type: str, reason: str) -> str:
    """The one-line refusal of `model_type` for `reason`, listing what each method accepts."""
    return f"architecture {model_type!r} is not supported: {reason}; {accepted()}"


def check_servable(model_type: str) -> Serving:
    """The tier of `model_type`; ConfigError (one line, `refusal`) for a refused one."""
    found = serving(model_type)
    if found.path == "refused":
        raise ConfigError(refusal(model_type, found.reason))
    return found


def causal_families() -> tuple[str, ...]:
    """Every model_type of transformers' causal-LM map, sorted."""
    return tuple(sorted(auto_map(CAUSAL_LM)))


def family_servings() -> tuple[Serving, ...]:
    """The tier of every model_type of transformers' causal-LM map (`causal_families`), as `presets
    --families` lists them: a family a new transformers release adds is served by the baselines or
    refused with its reason, by name alone."""
    return tuple(serving(model_type) for model_type in causal_families())

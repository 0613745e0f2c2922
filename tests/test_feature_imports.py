"""Another trainer's feature cache imported (`specdraft capture --from ...`, features/imports.py):
files written in the peers' exact layouts from the tiny target's real features train to the same
losses as our own capture of the same config.

Layouts relied on (speculators 0.9.0 as installed in .venv-speculators; hs-connectors 0.9.0):
- speculators/train/data.py:164 load_from_disk(datapath); :184 hs files under datapath/hidden_states;
  :310-331 hs_{i} holds hidden_states [T, n_layers, H] and token_ids [T], the last slot the
  verifier's last state; :314 token_ids must equal the row's input_ids.
- datasets/arrow_dataset.py:1868 state.json `_data_files` names data-XXXXX-of-XXXXX.arrow;
  datasets/arrow_writer.py:628 each is an Arrow IPC stream (RecordBatchStreamWriter).
- hs_connectors/fp8_utils.py: SCALES_KEY hidden_states_scales, quantize_tensor_to_fp8 per token.
- SpecForge (sgl-project/SpecForge a6b6b02; lines at write_specforge and SPECFORGE_LAYOUTS):
  rows_{g}-{g+2000}/data_{i}.ckpt(.gz), a dict of input_ids, loss_mask and its algorithm's states;
  its layer id k is vLLM's k + 1 (SGLang's set_eagle3_layers_to_capture: "[val + 1 for val in
  layer_ids]").
"""

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from offline_runs import run_config
from specdraft.errors import SpecdraftError
from specdraft.features.cache import FeatureCache
from specdraft.features.manifest import Manifest, committed_shards
from specdraft.features.shards import ShardReader
from specdraft.train.loop import train
from specdraft.commands.capture import capture
from specdraft.commands.import_features import import_cache

QUIET = dict(log=lambda *a: None)


@pytest.fixture(scope="module")
def runs(tiny_assets, served_target_dir, data_dir, tmp_path_factory):
    """(family, target) -> our fp32 capture's training losses, and the target's features of every row
    at the family's layers plus layer id L (what a peer run with those ids stores). target: "tiny"
    (2 layers) or "served" (its 4-layer copy: EAGLE-3's default layers 1, 2, 3 are ones SpecForge
    can name, its ids 0, 1, 2; on 2 layers EAGLE-3 reads id 0, the embeddings)."""
    import specdraft.commands.capture as capture_module

    tiny_target, tiny = tiny_assets
    targets = {"tiny": tiny_target, "served": served_target_dir}
    work = tmp_path_factory.mktemp("imports")
    extra = [
        "packing=whole",
        "max_seq_length=256",
        "max_steps=3",
        "warmup_steps=3",
        "save_steps=3",
        f"data_files=[{','.join(map(str, tiny.train_files))}]",
    ]
    done = {}

    def of(family, target_name="tiny"):
        key = family if target_name == "tiny" else f"{family}_{target_name}"
        if key in done:
            return done[key]

        def config(name, cache, *more):
            return run_config(
                targets[target_name],
                data_dir,
                work,
                family,
                f"{key}_{name}",
                *extra,
                f"feature_cache={cache}",
                "feature_cache_dtype=fp32",
                *more,
            )

        capture(config("cap", work / f"fc_{key}_ref"), **QUIET)
        reference = train(config("ref", work / f"fc_{key}_ref"), **QUIET).losses
        manifest = Manifest.read(work / f"fc_{key}_ref")
        num_layers = manifest.num_layers
        aux = sorted(int(k.split(".")[1]) for k in manifest.kinds if k.startswith("hidden."))
        original = capture_module.run_capture_request
        wide_dir = work / f"fc_{key}_wide"
        with pytest.MonkeyPatch.context() as patch:  # our capture, also storing layer id L
            patch.setattr(
                capture_module,
                "run_capture_request",
                lambda cfg, tc: dataclasses.replace(
                    original(cfg, tc), layers=tuple(sorted({*aux, num_layers})), final_hidden=True
                ),
            )
            capture(config("wide", wide_dir), **QUIET)
        wide = Manifest.read(wide_dir)
        kinds = list(wide.kinds)
        rows = []
        for entry in committed_shards(wide_dir, wide):
            reader = ShardReader(wide_dir, entry, kinds)
            for index in range(entry.rows):
                ids = reader.row_tokens(index).astype(np.int64)
                rows.append((ids, reader.row_features(index, len(ids), kinds, torch.float32)))
        rows.reverse()  # another order than ours: rows are matched by their token ids
        done[key] = dict(
            work=work,
            config=config,
            reference=reference,
            aux=aux,
            num_layers=num_layers,
            rows=rows,
            layers=sorted({*aux, num_layers}),
        )
        return done[key]

    return of


def write_speculators(directory, rows, layers, fp8=False):
    """The Arrow dataset written by `datasets` itself (save_to_disk, in the speculators venv: the
    layout speculators' trainer loads), and hidden_states/hs_{i}.safetensors."""
    import subprocess

    from speculators_env import require_speculators_python

    columns = {
        "input_ids": [ids.tolist() for ids, _ in rows],
        "loss_mask": [[1] * len(ids) for ids, _ in rows],
        "seq_len": [len(ids) for ids, _ in rows],
    }
    directory.parent.mkdir(parents=True, exist_ok=True)
    spec = directory.parent / f"{directory.name}.columns.json"
    spec.write_text(json.dumps(columns))
    script = (
        # set_format("torch"): speculators' trainer compares token_ids with the row's input_ids as tensors
        # (speculators/train/data.py:314; a list fails there), as bench/versus_features.py writes it
        "import json, sys, datasets; d = datasets.Dataset.from_dict(json.load(open(sys.argv[1]))); "
        "d.set_format('torch'); d.save_to_disk(sys.argv[2])"
    )
    subprocess.run(
        [str(require_speculators_python()), "-c", script, str(spec), str(directory)], check=True, capture_output=True
    )
    (directory / "hidden_states").mkdir()
    for i, (ids, features) in enumerate(rows):
        states = torch.stack([features[f"hidden.{layer}"] for layer in layers], dim=1)  # [T, n, H]
        tensors = {"token_ids": torch.from_numpy(ids).long()}
        if fp8:
            from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

            tensors["hidden_states"], tensors[SCALES_KEY] = quantize_tensor_to_fp8(states)
        else:
            tensors["hidden_states"] = states
        save_file(tensors, directory / "hidden_states" / f"hs_{i}.safetensors")
    return directory


# SpecForge's row keys per algorithm (its OfflineCaptureLayout: concatenated layers, last state after
# the final norm): scripts/prepare_hidden_states.py:402-410 (EAGLE-3, the default),
# specforge/algorithms/dflash/providers.py:200-206, specforge/algorithms/dspark/providers.py:175-181
SPECFORGE_LAYOUTS = {
    "eagle3": ("aux_hidden_state", "hidden_state"),
    "dflash": ("hidden_states", None),
    "dspark": ("hidden_states", "target_last_hidden_states"),
}


def write_specforge(directory, rows, aux, layout="eagle3", compress=False):
    """scripts/prepare_hidden_states.py:593-594 rows_{g}-{g+2000}/data_{i}.ckpt (:418 .ckpt.gz with
    --compress, :475-480 torch.save of the row's dict, gzipped); :709-726 input_ids and loss_mask [T],
    the states [1, T, ...]; the layers concatenated in capture order."""
    import gzip

    layers_key, final_key = SPECFORGE_LAYOUTS[layout]
    for i, (ids, features) in enumerate(rows):
        group = i // 2000 * 2000
        path = directory / f"rows_{group}-{group + 2000}" / f"data_{i}.ckpt{'.gz' if compress else ''}"
        path.parent.mkdir(parents=True, exist_ok=True)
        row = {
            "input_ids": torch.from_numpy(ids).long(),
            "loss_mask": torch.ones(len(ids), dtype=torch.long),
            layers_key: torch.cat([features[f"hidden.{layer}"] for layer in aux], dim=-1)[None],
        }
        if final_key is not None:
            row[final_key] = features["final_hidden"][None]
        if compress:
            with gzip.open(path, "wb") as file:
                torch.save(row, file)
        else:
            torch.save(row, path)
    return directory


def ids_text(layers):
    return ",".join(map(str, layers))


def import_specforge(setup, name, cache, source):
    """`capture --from specforge` of the family's layers, given in SpecForge's numbering (its k is
    vLLM's k + 1)."""
    specforge_ids = [layer - 1 for layer in setup["aux"]]
    return import_cache(setup["config"](f"imp_{name}", cache), "specforge", source, ids_text(specforge_ids), **QUIET)


def test_speculators_cache_trains_as_our_capture(runs):
    setup = runs("eagle3")
    work, layers = setup["work"], setup["layers"]
    source = write_speculators(work / "spec", setup["rows"], layers)
    cache = work / "fc_spec"
    report = import_cache(
        setup["config"]("imp_spec", cache), "speculators", source, ids_text(layers), strict=True, **QUIET
    )
    assert report.written == len(setup["rows"]) and report.unserved == 0
    assert "final norm applied" in Manifest.read(cache).kinds["final_hidden"]
    assert train(setup["config"]("spec", cache), **QUIET).losses == setup["reference"]


@pytest.mark.parametrize(
    "family, target, layout, compress",
    [
        # EAGLE-3 from SpecForge's EAGLE-3 rows: on the 4-layer target (layers 1, 2, 3: SpecForge's 0, 1, 2)
        ("eagle3", "served", "eagle3", False),
        # DSpark reads layer id 1 and the final norm's output: SpecForge's DSpark rows, and its EAGLE-3
        # rows (gzipped), which hold the same states under other keys
        ("dspark", "tiny", "dspark", False),
        ("dspark", "tiny", "eagle3", True),
        ("dflash", "tiny", "dflash", False),
    ],
)
def test_specforge_cache_trains_as_our_capture(runs, family, target, layout, compress):
    setup = runs(family, target)
    work = setup["work"]
    name = f"sf_{family}_{target}_{layout}{'_gz' if compress else ''}"
    source = write_specforge(work / name, setup["rows"], setup["aux"], layout, compress)
    cache = work / f"fc_{name}"
    assert min(setup["aux"]) >= 1  # ids SpecForge can name
    report = import_specforge(setup, name, cache, source)
    assert report.written == len(setup["rows"]) and report.unserved == 0
    assert train(setup["config"](name, cache), **QUIET).losses == setup["reference"]


def test_specforge_dflash_rows_are_refused_for_a_draft_that_reads_the_final_norm(runs):
    setup = runs("dspark")
    work = setup["work"]
    source = write_specforge(work / "sf_nofinal", setup["rows"][:1], setup["aux"], "dflash")
    with pytest.raises(SpecdraftError) as err:
        import_specforge(setup, "nofinal", work / "fc_nofinal", source)
    message = str(err.value)
    assert "\n" not in message and "final norm" in message and "data_0.ckpt" in message


def test_fp8_speculators_cache_imports_and_trains(runs):
    from hs_connectors.transfer import FP8Transfer

    setup = runs("eagle3")
    work, layers = setup["work"], setup["layers"]
    source = write_speculators(work / "spec8", setup["rows"], layers, fp8=True)
    cache = work / "fc_spec8"
    import_cache(setup["config"]("imp_spec8", cache), "speculators", source, ids_text(layers), **QUIET)
    # what hs-connectors dequantises is what the cache holds (fp32: no second rounding)
    expected = FP8Transfer(source / "hidden_states", dequantize_dtype=torch.float32).get_cached(0)
    manifest = Manifest.read(cache)
    opened = FeatureCache(cache, manifest, list(manifest.kinds))
    ids = np.asarray(setup["rows"][0][0])
    found = []
    for places in opened.rows.values():
        for place in places:
            reader = ShardReader(cache, place.entry, list(manifest.kinds))
            if np.array_equal(reader.row_tokens(place.index), ids[: place.length]):
                found.append((reader, place))
    assert len(found) == 1  # foreign row 0, found by its token ids
    reader, place = found[0]
    stored = reader.row_features(place.index, place.length, [f"hidden.{layers[0]}"], torch.float32)
    assert torch.equal(stored[f"hidden.{layers[0]}"], expected["hidden_states"][: place.length, 0])
    losses = train(setup["config"]("spec8", cache), **QUIET).losses
    assert all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx(setup["reference"], rel=0.05)


def test_token_ids_disagreeing_with_the_dataset_are_refused(runs):
    setup = runs("eagle3")
    work, layers = setup["work"], setup["layers"]
    source = write_speculators(work / "spec_bad", setup["rows"][:2], layers)
    bad = source / "hidden_states" / "hs_1.safetensors"
    from safetensors.torch import load_file

    tensors = load_file(bad)
    tensors["token_ids"] = tensors["token_ids"].flip(0)
    save_file(tensors, bad)
    with pytest.raises(SpecdraftError) as err:
        import_cache(setup["config"]("imp_bad", work / "fc_bad"), "speculators", source, ids_text(layers), **QUIET)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(bad)) and "token_ids" in message


def test_specforge_file_with_a_pickled_object_is_refused(runs):
    setup = runs("dspark")
    work = setup["work"]
    source = write_specforge(work / "sf_bad", setup["rows"][:1], setup["aux"])
    bad = next(source.glob("rows_*/data_0.ckpt"))
    row = torch.load(bad, weights_only=True)
    row["extra"] = _Pickled()
    torch.save(row, bad)
    with pytest.raises(SpecdraftError) as err:
        import_specforge(setup, "sfbad", work / "fc_sfbad", source)
    message = str(err.value)
    assert "\n" not in message and message.startswith(str(bad)) and "weights_only" in message


class _Pickled:
    """An object only a full unpickle recreates (what weights_only refuses)."""


def test_a_layer_the_drafts_need_is_refused_by_id(runs):
    setup = runs("eagle3")
    work, layers = setup["work"], [layer for layer in setup["layers"] if layer != setup["aux"][1]]
    source = write_speculators(work / "spec_few", setup["rows"][:1], layers)
    with pytest.raises(SpecdraftError, match=f"layer id {setup['aux'][1]} "):
        import_cache(setup["config"]("imp_few", work / "fc_few"), "speculators", source, ids_text(layers), **QUIET)
    # without layer id L the final norm's output cannot be computed
    setup = runs("dspark")
    source = write_speculators(work / "spec_nol", setup["rows"][:1], setup["aux"])
    with pytest.raises(SpecdraftError, match="final norm"):
        import_cache(
            setup["config"]("imp_nol", work / "fc_nol"), "speculators", source, ids_text(setup["aux"]), **QUIET
        )


def test_rows_of_other_data_are_counted_or_refused_when_strict(runs):
    setup = runs("eagle3")
    work, layers = setup["work"], setup["layers"]
    ids, features = setup["rows"][0]
    other = [(ids[::-1].copy(), features)]  # ids of no conversation of the data
    source = write_speculators(work / "spec_other", other, layers)
    report = import_cache(setup["config"]("imp_o", work / "fc_o"), "speculators", source, ids_text(layers), **QUIET)
    assert report.unmatched == 1 and report.written == 0
    with pytest.raises(SpecdraftError) as err:
        import_cache(
            setup["config"]("imp_o2", work / "fc_o2"), "speculators", source, ids_text(layers), strict=True, **QUIET
        )
    assert "\n" not in str(err.value) and str(err.value).startswith(str(source / "hidden_states" / "hs_0.safetensors"))

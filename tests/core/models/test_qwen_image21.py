"""Qwen-Image-2.1 beyond the conformance suite: a batch of prompts of other lengths and slot layouts predicts
each sample as alone, references the processor would resize or prompts without their slots are refused in one
line, the reference latents are the pipeline's, its files as released (DiffSynth's download without configs,
ComfyUI's fused DiT) load the reference model, configs inferred from the released shapes are the release's."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffsynth_core.errors import InputError
from diffsynth_core.models import check_model_folder, get_family, known_families, released
from diffsynth_core.models.loading import load_component as load_reference
from diffsynth_core.models.qwen_image21_released import fused

from .family_cases import qwen21_images

SPEC = get_family("qwen_image21")
FORMATS = {name: get_family(name).released_formats for name in known_families()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return SPEC.save_tiny_model(tmp_path_factory.mktemp("qwen21") / "model", 0)


@pytest.fixture(scope="module")
def components(tiny):
    return SPEC.load_components(tiny, SPEC.encoder_components + ("transformer",), torch.float32, "cpu")


def _entries(components, prompts_and_images):
    """Cache entries of one bucket (target 32x64, one 32x64 reference), stacked as a batch pads them."""
    from diffsynth_core.training.batching import stack_entries

    g = torch.Generator().manual_seed(0)
    entries = []
    for prompt, images in prompts_and_images:
        entry = SPEC.encode_prompt(components, prompt, "cpu", images=images)
        entry["latents"] = torch.randn(64, 1, 2, 4, generator=g)
        entry["ref_latents_0"] = torch.randn(64, 1, 2, 4, generator=g)
        entries.append(entry)
    return stack_entries(entries, SPEC.batch_padding)


def test_a_batch_of_other_prompt_lengths_and_slot_layouts_predicts_each_sample_as_alone(components):
    reference = qwen21_images()[0]  # 64x32: two slots
    batch = _entries(components, [("a cat", [reference]), ("a red cat on a blue photo", [reference]),
                                  ("a dog", [reference])])
    assert batch["image_pad_mask"].dtype == torch.bool and batch["prompt_embeds_mask"][0, -1] == 0  # padded
    latents = batch.pop("latents")
    sigmas = torch.tensor([0.2, 0.5, 0.9])
    transformer = components["transformer"]
    with torch.no_grad():
        together = SPEC.dit_forward(transformer, latents, sigmas, batch)
        alone = [SPEC.dit_forward(transformer, latents[i:i + 1], sigmas[i:i + 1],
                                  {k: v[i:i + 1, :int(batch["prompt_embeds_mask"][i].sum())] if v.ndim == 2 or k
                                   == "prompt_embeds" else v[i:i + 1] for k, v in batch.items()}) for i in range(3)]
    torch.testing.assert_close(together, torch.cat(alone), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(together[0], together[2])


def test_a_reference_the_processor_would_resize_is_refused_in_one_line(components):
    processor = components["processor"]
    kept = processor.image_processor.size["shortest_edge"]
    processor.image_processor.size["shortest_edge"] = 64 * 64  # a 64x32 reference is below it: upscaled
    try:
        with pytest.raises(InputError, match="64x32 reference becomes 96x64 .* 4096 to .* dataset.reference_pixels") \
                as error:
            SPEC.encode_prompt(components, "a cat", "cpu", images=[qwen21_images()[0]])
    finally:
        processor.image_processor.size["shortest_edge"] = kept
    assert error.value.exit_code == 2


def test_an_edit_whose_prompt_holds_no_slots_for_its_references_is_refused(components):
    """A prompt encoded without its references (the shared empty prompt, say) beside an edit's reference latents."""
    batch = _entries(components, [("", None)])
    latents = batch.pop("latents")
    with pytest.raises(InputError, match="holds 0 image slots but its 1 reference latents need 2"):
        SPEC.dit_forward(components["transformer"], latents, torch.tensor([0.5]), batch)


def test_reference_latents_are_the_pipelines_image_latents(tiny, components):
    """Stage 1's latents of an RGBA reference (as the dataset gives its pixels) equal the pipeline's
    ``prepare_latents`` image latents for the same image, which it packs ahead of the target."""
    import numpy as np
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline(scheduler=None, vae=components["vae"], text_encoder=None,
                               processor=components["processor"], transformer=None)
    image = qwen21_images()[0]
    vae_input = pipe.image_processor.preprocess(image, width=64, height=32).unsqueeze(2)
    _, theirs = pipe.prepare_latents([vae_input], 1, 64, 64, 64, torch.float32, "cpu", None)
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[:, None].float() / 127.5 - 1
    ours = SPEC.encode_pixels(components, pixels, "cpu")["latents"]
    torch.testing.assert_close(pipe._pack_latents(ours[None], 1, 64, 2, 4), theirs, rtol=1e-5, atol=1e-6)


def test_a_2_1_folder_given_as_qwen_image_names_the_family(tiny):
    with pytest.raises(InputError, match="set model.family = 'qwen_image21'"):
        check_model_folder(get_family("qwen_image"), tiny)


# --- files as released --------------------------------------------------------------------------

def _same_model(model, reference):
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_diffsynth_downloads_without_configs_load_the_reference_model(tiny, tmp_path):
    """Qwen/Qwen-Image-2.1's transformer/, text_encoder/ and vae/ weights as DiffSynth's patterns fetch them
    (no config.json): recognised as Qwen-Image-2.1 alone (not Qwen-Image, whose encoder and VAE differ)."""
    for component in ("transformer", "text_encoder", "vae"):
        folder = tmp_path / component
        folder.mkdir()
        for file in (tiny / component).glob("*.safetensors"):
            shutil.copy(file, folder)
        files = sorted(folder.iterdir())
        assert {(family, fmt.component) for family, fmt in released.recognise(FORMATS, files)} == \
            {("qwen_image21", component)}
        _same_model(released.load_named(SPEC.released_formats, component, files, torch.float32),
                    load_reference(tiny, component, torch.float32))


def test_comfyui_fused_dit_file_loads_the_reference_model(tiny, tmp_path):
    dit = load_file(str(tiny / "transformer" / "diffusion_pytorch_model.safetensors"))
    file = tmp_path / "qwen_image_2.1_bf16.safetensors"
    save_file({"model.diffusion_model." + k: v for k, v in fused(dit).items()}, str(file))
    reference = load_reference(tiny, "transformer", torch.float32)
    _same_model(released.load_named(SPEC.released_formats, "transformer", [file], torch.float32), reference)
    _same_model(SPEC.load_transformer_file(file, tiny, torch.float32), reference)


def test_configs_inferred_from_released_shapes_are_the_released_configs():
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKLQwenImage21
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from diffsynth_core.models.qwen_image21_released import ENCODER_CONFIGS, FORMATS as OURS

    plain = lambda config: {k: list(v) if isinstance(v, tuple) else v for k, v in dict(config).items()
                            if not k.startswith("_")}
    shapes = lambda model: {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fmt = {f.component: f for f in OURS if f.convert is None}
    dit = SPEC.build_transformer("Qwen-Image-2.1", torch.bfloat16, "meta")
    assert sum(p.numel() for p in dit.parameters()) == pytest.approx(7.0e9, rel=0.02)
    with init_empty_weights():
        assert plain(type(dit).from_config(fmt["transformer"].infer_config(shapes(dit))).config) == plain(dit.config)
        vae = AutoencoderKLQwenImage21()
        assert plain(AutoencoderKLQwenImage21.from_config(fmt["vae"].infer_config(shapes(vae))).config) == \
            plain(vae.config)
        layout = ENCODER_CONFIGS["Qwen-Image-2.1"]
        config = Qwen3VLConfig(text_config=layout["text"], vision_config=layout["vision"])
        text = Qwen3VLForConditionalGeneration(config)
    inferred = fmt["text_encoder"].infer_config(shapes(text))
    for part in ("text", "vision"):
        for key, value in layout[part].items():
            assert inferred[f"{part}_config"][key] == value, (part, key)

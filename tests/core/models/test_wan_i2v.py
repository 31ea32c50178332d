"""Wan image-to-video against diffusers' ``WanImageToVideoPipeline`` on tiny models: what
``encode_references`` caches equals what the pipeline conditions on, and ``dit_forward`` over it
equals the pipeline's own transformer call (Wan2.1 I2V with CLIP, Wan2.2 I2V-A14B, TI2V-5B with a
first frame)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from diffsynth_core.models import get_family

PROMPT = "a red square moving right"


def _image():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))


def _pixels(image):  # as the dataset reads an image: (3, 1, H, W) in [-1, 1]
    return (torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255 * 2 - 1)[:, None]


@pytest.fixture(autouse=True)
def _prompt_clean_without_ftfy(monkeypatch):
    """diffusers 0.42's I2V pipeline calls ftfy unguarded (its T2V one checks it is installed; it is
    not here): the T2V cleaning, which is the same without ftfy."""
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)


def _pipeline_call(folder, image):
    from diffusers import WanImageToVideoPipeline

    pipe = WanImageToVideoPipeline.from_pretrained(folder)
    seen = {}
    def first_call(module, args, kwargs, out):
        seen.setdefault("call", (kwargs, out[0]))  # returns None: the output is left alone

    pipe.transformer.register_forward_hook(first_call, with_kwargs=True)
    pipe(image=image, prompt=PROMPT, height=64, width=64, num_frames=5, num_inference_steps=2, guidance_scale=1.0,
         max_sequence_length=32, output_type="latent", generator=torch.Generator().manual_seed(0))
    return pipe, *seen["call"]


@pytest.mark.parametrize("variant", ["i2v", "i2v-a14b"])
def test_concatenated_conditioning_matches_the_pipeline(variant, tmp_path):
    spec = get_family("wan", variant)
    folder = spec.save_tiny_model(tmp_path / "model", 0)
    image = _image()
    pipe, kwargs, out = _pipeline_call(folder, image)
    components = spec.load_components(folder, spec.encoder_components, torch.float32, "cpu")
    refs = spec.encode_references(components, [_pixels(image)], "cpu", target_shape=(3, 5, 64, 64))
    hidden = kwargs["hidden_states"]
    assert hidden.shape[1] == 36
    assert torch.equal(refs["ref_mask_0"], hidden[0, 16:20])
    assert torch.allclose(refs["ref_latents_0"], hidden[0, 20:], atol=1e-5)
    if variant == "i2v":  # Wan2.1 I2V: CLIP's penultimate hidden states
        assert torch.allclose(refs["image_embeds"], kwargs["encoder_hidden_states_image"][0], atol=1e-5)
    else:
        assert "image_embeds" not in refs and kwargs["encoder_hidden_states_image"] is None
    cond = {"prompt_embeds": kwargs["encoder_hidden_states"], **{k: v[None] for k, v in refs.items()}}
    with torch.no_grad():
        ours = spec.dit_forward(pipe.transformer, hidden[:, :16], kwargs["timestep"].float() / 1000, cond)
    assert ours.shape == out.shape and torch.allclose(ours, out, atol=1e-5)


def test_ti2v_first_frame_matches_the_pipeline_and_is_not_trained(tmp_path):
    spec = get_family("wan", "ti2v-5b")
    folder = spec.save_tiny_model(tmp_path / "model", 0)
    image = _image()
    pipe, kwargs, out = _pipeline_call(folder, image)
    components = spec.load_components(folder, spec.encoder_components, torch.float32, "cpu")
    refs = spec.encode_references(components, [_pixels(image)], "cpu", target_shape=(3, 5, 64, 64))
    hidden, t = kwargs["hidden_states"], kwargs["timestep"]
    assert torch.allclose(refs["ref_latents_0"], hidden[0, :, :1], atol=1e-5)  # the first latent frame, given
    tokens_per_frame = (64 // 32) * (64 // 32)
    assert torch.all(t[:, :tokens_per_frame] == 0) and torch.all(t[:, tokens_per_frame:] > 0)
    sigmas = t[:, -1].float() / 1000
    cond = {"prompt_embeds": kwargs["encoder_hidden_states"], "ref_latents_0": refs["ref_latents_0"][None]}
    noisy = hidden.clone()
    noisy[:, :, 0] = torch.randn_like(noisy[:, :, 0])  # the training input's own noisy first frame
    with torch.no_grad():
        ours = spec.dit_forward(pipe.transformer, noisy, sigmas, cond)
    assert torch.allclose(ours[:, :, 1:], out[:, :, 1:], atol=1e-5)  # generated frames: the pipeline's
    # the given frame: the velocity taking the noisy frame to it, so its loss term has no gradient
    expected = (noisy[:, :, :1] - refs["ref_latents_0"][None]) / sigmas.view(-1, 1, 1, 1, 1)
    assert torch.allclose(ours[:, :, :1], expected, atol=1e-5)


def test_i2v_without_first_frame_latents_is_one_line_naming_what_is_missing(tmp_path):
    from diffsynth_core.errors import InputError

    spec = get_family("wan", "i2v-a14b")
    dit = spec.load_components(spec.save_tiny_model(tmp_path / "m", 0), ("transformer",), torch.float32,
                               "cpu")["transformer"]
    with pytest.raises(InputError, match="first-frame latents \\(ref_latents_0\\), which this cache lacks"):
        spec.dit_forward(dit, torch.zeros(1, 16, 2, 8, 8), torch.tensor([0.5]), {"prompt_embeds": torch.zeros(1, 4, 32)})

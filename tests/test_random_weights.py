"""Real architectures from the shipped configurations (trl_dance/model_configs), with random weights: the published
sizes, and their closed-form FLOPs against a count by hand."""

import pytest
import torch

from trl_dance.flops import SAMPLE, forward_flops
from trl_dance.policies import policy_class
from trl_dance.random_weights import random_weight_models, random_weight_pipeline

# Parameters of the denoiser(s) in billions, as the checkpoints publish them (diffusers' counts of their weights).
PUBLISHED = {
    "flux-dev": 11.90,
    "sd35-medium": 2.24,
    "qwen-image": 20.43,
    "wan21-1.3b": 1.42,
    "wan21-14b": 14.29,
    "wan22-a14b": 14.29,
    "hunyuan-video": 12.82,
    "z-image-turbo": 6.15,
    "hunyuan-video15": 8.33,
    # FLUX.2 [klein] base 4B: 5 double and 20 single blocks of 24 heads, Qwen3-4B's 3 × 2560 text width (the
    # configuration as public reimplementations of the gated checkpoint read it; not checked against its own file).
    "flux2-klein-base-4b": 3.88,
    "ltx2": 18.88,  # LTX-2 "19B": its video and audio streams (Gemma 3 12B and the 1.4B connectors beside it)
    "minimax-h3": 33.12,  # MiniMax-H3 "33B" (diffusers' defaults, documented as the released configuration)
}


def test_every_shipped_configuration_builds_at_its_published_size():
    assert random_weight_models() == sorted(PUBLISHED)
    for name, billions in PUBLISHED.items():
        with torch.device("meta"):
            pipeline = random_weight_pipeline(name)
        assert sum(p.numel() for p in pipeline.transformer.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
        policy_class(pipeline)  # a family trl-dance trains
    with torch.device("meta"):
        wan22 = random_weight_pipeline("wan22-a14b", layers=1)
    assert wan22.config.boundary_ratio == 0.875 and len(wan22.transformer_2.blocks) == 1
    # Text encoders keep 3 layers: pipelines read hidden states up to 3 from the end (HunyuanVideo 1.5, Z-Image).
    assert len(wan22.transformer.blocks) == 1 and wan22.text_encoder.config.num_layers == 3
    with torch.device("meta"):  # Qwen2.5-VL lists one attention type per layer: shrunk with the depth
        qwen = random_weight_pipeline("qwen-image", layers=1)
    assert qwen.text_encoder.config.text_config.layer_types == ["full_attention"] * 3
    with torch.device("meta"):  # a modular pipeline; its conditioner keeps the 51 layers the transformer reads
        h3 = random_weight_pipeline("minimax-h3", layers=1)
    assert type(h3).__name__ == "MiniMaxH3ModularPipeline" and len(h3.transformer.transformer_blocks) == 1
    assert h3.text_encoder.config.text_config.num_hidden_layers == 51 and h3.processor is not None
    with pytest.raises(ValueError, match="unknown model 'flux-schnell'"):
        random_weight_pipeline("flux-schnell")


def test_flux_dev_forward_flops_by_hand():
    """FLUX.1-dev at 1024² (4096 image + 512 text tokens): every token meets 19 double-stream blocks' q/k/v/out and
    MLP of its stream and 38 single-stream blocks (the modulation is per sample), attention is 4·L²·3072 per block."""
    with torch.device("meta"):
        pipeline = random_weight_pipeline("flux-dev")
    width, mlp, tokens, blocks = 3072, 4 * 3072, 4096 + 512, 19 + 38
    per_token = 2 * (4 * width * width + 2 * width * mlp)  # a double block's stream; a single block's is the same
    embed = 2 * 4096 * 64 * width + 2 * 512 * 4096 * width + 2 * 4096 * width * 64  # x and text embedders, output
    attention = 4 * tokens**2 * width * blocks
    layout = policy_class(pipeline).flop_layout
    counted = forward_flops(pipeline.transformer, layout, {"image": 4096, "text": 512, SAMPLE: 1})
    # The rest (time, guidance and pooled-text embedders; AdaLN modulation) is per sample: under 0.1 %.
    assert counted == pytest.approx(per_token * tokens * blocks + embed + attention, rel=1e-3)

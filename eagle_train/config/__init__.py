"""Typed configuration schemas shared by every stage, and the one grammar of every command line.

Each stage has its schema in a module of this package (`extract`, `train`, `evaluate`, `regenerate`,
`export`, `pipeline`; shared parts `target`, `data`, `draft`, `decode`). The dataclasses hold every
default and its one-line doc; YAML under `conf/` holds real overrides only; `to_schema` turns Hydra's
DictConfig into the dataclass once, at the entry point. Nothing below an entry point sees a DictConfig.

Configuration grammar (every `python -m eagle_train.<stage>` and `accelerate launch train.py`):

    key=value            any field of the stage's schema, nested with dots (decode.depth=3, optim.lr=1e-4,
                         target.path=DIR); a misspelt key fails before anything runs
    target=NAME          which model: conf/target/NAME.yaml (path, dtype, chat template, stop tokens,
                         training length); every stage that loads the target
    data=NAME            which conversations: conf/data/NAME.yaml (or data.path=FILE); extract, train
                         (online), regenerate
    +recipe=NAME         train only: a training recipe layered on the schema's defaults (which are the
                         reference recipe for 7B targets): conf/recipe/NAME.yaml; `+` because a run has
                         none unless asked
    experiment=NAME      pipeline only: the stages of one experiment and their arguments:
                         conf/experiment/NAME.yaml (one preset may extend another through its defaults)
    vars.NAME=value      pipeline only: an experiment's own settings, used as ${vars.NAME} in its stages'
                         arguments (vars.processes=1, vars.target=qwen3_8b)
    +overrides.STAGE=[...]  pipeline only: more arguments for one stage ('+overrides.train=["max_steps=10"]')

Outputs: `out_dir=DIR` where a stage writes a directory (extract, train, evaluate, export, pipeline),
`out=FILE` where it writes one file (regenerate, `python -m eagle_train.data.mix`,
`python -m eagle_train.data.tinystories`). A stage run alone writes under outputs/ by default
(outputs/features/TARGET/DATA, outputs/train/TARGET, outputs/eval/TARGET,
outputs/regenerated/TARGET_DATA.jsonl; export has no default); an experiment writes all its stages
under runs/NAME/ (data/, features/, train/, eval/).

A field whose default is null means "chosen for you" (decode.chain_length / depth / top_k /
total_tokens under decode.shape=auto, num_threads, data.max_len): a value given on the command line is
always honoured, even one equal to what would have been chosen.
"""

from eagle_train.config.base import CONF_DIR, DATA_DIR, data_path, resolve_path, to_schema
from eagle_train.config.target import TargetConfig

__all__ = ["CONF_DIR", "DATA_DIR", "TargetConfig", "data_path", "resolve_path", "to_schema"]

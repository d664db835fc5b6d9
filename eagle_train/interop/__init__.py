"""Draft heads in other projects' layouts: the serving engines' (vLLM, SGLang), the EAGLE reference's and the
speculators format, written by export and read back by `load_draft`.

layouts.py          EAGLE-1/2 heads in every layout, the one importer (`load_draft`) and `export_head`
eagle3_layouts.py   EAGLE-3 heads in those layouts and the speculators format
dflash_layouts.py   DFlash heads in vLLM's (z-lab's) layout and the speculators format
reexpress.py        the same Llama with a larger head_dim, exactly (vLLM's CPU attention needs 32+);
                    (`python -m eagle_train.interop.reexpress [SRC] OUT [--head-dim 32]`)
"""

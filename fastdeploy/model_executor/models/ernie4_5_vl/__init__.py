"""ERNIE-4.5-VL, the whole family in one place: its config.json (`config`), the language model (`model`)
and vision encoder (`vision`), the request side (`processor`: media -> pixels, grids and the expanded
prompt; `image_processor`, `video_processor`; `positions`: token types and 3-D rotary positions)
and what the engine asks of it per request and per step (`step_inputs`).

Kept empty on purpose: the engine and the entrypoints import the request-side modules, which must not pull
in the Paddle model code, and the model registry imports `model` on first use.
"""

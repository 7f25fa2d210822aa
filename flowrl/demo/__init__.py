"""``flowrl demo`` and ``flowrl gallery``: compare aligned checkpoints side by side.

Modules: :mod:`~flowrl.demo.validation` (request bounds), :mod:`~flowrl.demo.registry` (which run
folders may be opened), :mod:`~flowrl.demo.generation` (sampling and scoring a comparison),
:mod:`~flowrl.demo.plots` (reward curves, frame strips), :mod:`~flowrl.demo.app` (the Gradio
Blocks) and :mod:`~flowrl.demo.gallery` (the README images). Gradio is imported only by ``app``.
"""

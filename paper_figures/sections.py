"""The registry of the main job's sections, run in this order by ``python -m paper_figures``.

To add a section (the steps are in the package docstring, ``paper_figures/__init__.py``): write a
module with ``run(*, profile, out) -> list[SummaryRow]`` and append one ``Section`` here.

Legend: Ψ = num_params, N_d = world_size, K = the optimizer-state multiplier.
"""

from __future__ import annotations

from paper_figures import fig1_memory, sim_check, table1_memory, table2_max_model
from paper_figures.common import Section

SECTIONS: list[Section] = [
    Section(name=fig1_memory.NAME, run=fig1_memory.run, about="Figure 1: Ψ = 7.5B at N_d = 64"),
    Section(name=table1_memory.NAME, run=table1_memory.run, about="Table 1: GB per device vs N_d"),
    Section(name=table2_max_model.NAME, run=table2_max_model.run, about="Table 2: max model size"),
    Section(name=sim_check.NAME, run=sim_check.run, about="NumPy N-rank simulation vs formulas"),
]

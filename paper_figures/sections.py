"""The registry of the main job's sections, run in this order by ``python -m paper_figures``.

Where they live, by the paper's subject: ``model_states/`` (ZeRO-DP's memory: Figure 1, Tables 1
and 2, the simulated ranks and the NumPy simulation), ``performance/`` (step time and throughput:
Figures 2-4, measured on CPU and GPU and modelled, and ZeRO++'s modelled speedup); at the top,
the communication volume (``comm_volume``; ZeRO++'s per link, ``zeropp_volume``) and ZeRO-R's
residual memory (``activation_memory``, ``zero_r_configs``, ``zero_r_mp``), beside the machinery
every section shares (``common``, ``paper``, ``index``).

To add a section (the steps are in the package docstring, ``paper_figures/__init__.py``): write a
module with ``run(*, profile, out) -> list[SummaryRow]``, in the folder of its subject, and append
one ``Section`` here.
``simulated_ranks`` runs before Figure 1 and Table 1, which draw its measured records; ``index``
runs last and reads every other section's results.

Legend: Ψ = num_params, N_d = world_size, K = the optimizer-state multiplier.
"""

from __future__ import annotations

from paper_figures import (
    activation_memory,
    comm_volume,
    index,
    zero_r_configs,
    zero_r_mp,
    zeropp_volume,
)
from paper_figures.common import Section
from paper_figures.model_states import (
    fig1_memory,
    sim_check,
    simulated_ranks,
    table1_memory,
    table2_max_model,
)
from paper_figures.performance import (
    gpu_throughput,
    perf_model,
    throughput,
    throughput_mp,
    zeropp_model,
)

SECTIONS: list[Section] = [
    Section(
        name=simulated_ranks.NAME,
        run=simulated_ranks.run,
        about="one simulated rank measured outside the engine (full: 7.5B/128B/1T where it fits)",
    ),
    Section(name=fig1_memory.NAME, run=fig1_memory.run, about="Figure 1: Ψ = 7.5B at N_d = 64"),
    Section(name=table1_memory.NAME, run=table1_memory.run, about="Table 1: GB per device vs N_d"),
    Section(name=table2_max_model.NAME, run=table2_max_model.run, about="Table 2: max model size"),
    Section(name=sim_check.NAME, run=sim_check.run, about="NumPy N-rank simulation vs formulas"),
    Section(
        name=comm_volume.NAME,
        run=comm_volume.run,
        about="bytes per rank per step on gloo ranks: 2Ψ/2Ψ/2Ψ/3Ψ",
    ),
    Section(
        name=zeropp_volume.NAME,
        run=zeropp_volume.run,
        about="ZeRO++: bytes per link per step, analytic and counted at 2 x 2 (5 schemes)",
    ),
    Section(
        name=activation_memory.NAME,
        run=activation_memory.run,
        about="activation memory: the footnote's formula vs measurement",
    ),
    Section(
        name=perf_model.NAME,
        run=perf_model.run,
        about="performance model: fitted on Figure 4, Figures 2-3 held out",
    ),
    Section(
        name=zeropp_model.NAME,
        run=zeropp_model.run,
        about="ZeRO++'s speedup over ZeRO-3: two-link model beside the reported (not measured)",
    ),
    Section(
        name=throughput.NAME,
        run=throughput.run,
        about="step time vs DDP, ZeRO-R, FSDP2, DeepSpeed (quick: the committed measurement)",
    ),
    Section(
        name=throughput_mp.NAME,
        run=throughput_mp.run,
        about="Figure 2's shape at N = 4: Megatron vs ZeRO at N_m = 1, 2, 4 (quick: committed)",
    ),
    Section(
        name=zero_r_configs.NAME,
        run=zero_r_configs.run,
        about="C1-C5 (Figures 6-8): largest model, memory, throughput (quick: committed)",
    ),
    Section(
        name=zero_r_mp.NAME,
        run=zero_r_mp.run,
        about="C1-C5 at MP = 16 on simulated ranks: largest model, memory (quick: committed)",
    ),
    Section(
        name=gpu_throughput.NAME,
        run=gpu_throughput.run,
        about="step time and MFU at N = 1 on a GPU (the committed GPU records, if any)",
    ),
    Section(name=index.NAME, run=index.run, about="INDEX.md: the paper's numbers beside ours"),
]

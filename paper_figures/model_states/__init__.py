"""The sections on model states (ZeRO-DP): their memory per device and the simulation's bytes.

- ``simulated_ranks``: one simulated rank measured outside the engine, the bars and cells below;
- ``fig1_memory``: Figure 1, 7.5B at N_d = 64 by stage;
- ``table1_memory``: Table 1, GB per device against the DP degree;
- ``table2_max_model``: Table 2, the largest model that fits 32 GB;
- ``sim_check``: the NumPy simulation of N ranks against the formulas, bytes and traffic.

Each is a section of ``python -m paper_figures`` (registered in ``paper_figures/sections.py``);
the communication volume on gloo ranks is ``paper_figures/comm_volume.py``.
"""

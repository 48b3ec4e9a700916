"""The parts that measure's two largest instruments are built from, kept apart so that each
command's own module reads as its driver; every public name is importable from the command's
module too (measure.bench, measure.bench_table, measure.fake_rank).

    bench_config.py        measure.bench's workloads (MODELS) and configuration (BenchConfig)
    trainers.py            the systems measure.bench times, inside one rank
    bench_systems.py       the systems' names, sharding levels and analytic model states
    bench_ranks.py         what each rank runs: build, time, profile, the memory pass, the peak
    bench_records.py       one record per (system, N) from what the ranks measured
    bench_format.py        the tables drawn from measure.bench's records
    fake_rank_config.py    measure.fake_rank's SimulateConfig and its checks
    fake_rank_estimate.py  a simulated rank's peak, estimated before anything is built
"""

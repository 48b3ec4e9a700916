"""Running ranks and keeping them honest: starting a world, and naming the rank to blame.

    launch.py    join a torchrun world (init_from_env), or fork a local one (spawn, WorkerPool)
    signals.py   SIGINT/SIGTERM and a parent's death end every rank (Janitor, SignalGuard)
    watchdog.py  collective fingerprints: a diverging, stopped or departed rank is named
    beacon.py    heartbeats beside the rendezvous store: a dead or stuck rank is named

Nothing here imports the engine; the engine and the entry points use these modules.
"""

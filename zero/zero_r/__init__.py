"""ZeRO-R (paper §6) as policies the stages are given, never branches inside a stage.

Legend: C_B the constant buffer size, M_D memory defragmentation, "placement" where a buffer
lives (device, an arena, the host).
    placement.py    Placement: gradient buffers (own allocation, arena view, host) and the
                    counted copies between the optimizer's side and the device
    offload.py      HostOffload: ZeRO-Offload's host buffers and counted transfers
    contiguous.py   M_D: the gradient arenas and the activation-checkpoint arena
    buckets.py      C_B: whole-buffer reductions or constant-size pieces
    activations.py  activation checkpointing per unit, checkpoints offloaded or in an arena
"""

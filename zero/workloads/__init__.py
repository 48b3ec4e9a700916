"""Workloads and the training application, built on the library (they sit above the engine).

    models.py    the project's GPT and MLP, their data, and the counter-based init rules
    resnet.py    a small ResNet with BatchNorm; digits.py trains it on scikit-learn's digits
    lora.py      LoRA adapters on a frozen model
    data.py      byte-level text from the Python standard library's source
    train.py     python -m zero.workloads.train: training with checkpoints, resume and a curve
    train_config.py  its command line: TrainConfig, the model sizes, parse
    history.py   a run's loss history on disk, beside the checkpoints

The loop every entry point shares, train_steps, is zero/loop.py's.
"""

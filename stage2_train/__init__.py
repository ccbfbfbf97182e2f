"""Stage 2: train, evaluate and export the drafter from the feature store (`python -m stage2_train`).

Importing the stage makes its config sections known to the shared loader (the rooms' torch-free
`config` modules, and observe's); stage 1's sections in the same file are kept as given and
validated by stage 1's entry point.
"""

from shared.config import register_sections
from stage2_train.data.config import SamplerConfig
from stage2_train.model.config import DrafterConfig, LossConfig
from stage2_train.observe.config import DetectorConfig, LogConfig
from stage2_train.train.config import CheckpointConfig, EvalConfig, NoiseConfig, OptimConfig, TrainConfig

register_sections(
    SamplerConfig, NoiseConfig, DrafterConfig, LossConfig, OptimConfig, TrainConfig, CheckpointConfig, EvalConfig,
    LogConfig, DetectorConfig,
)

"""Stage 1: regenerate, extract and maintain the feature store (`python -m stage1_extract`).

Importing the stage makes its config sections (data, generate, extract) known to the shared loader;
stage 2's sections in the same file are kept as given and validated by stage 2's entry point.
"""

from shared.config import register_sections
from stage1_extract.data import DataConfig
from stage1_extract.extract import ExtractConfig
from stage1_extract.generate import GenerateConfig

register_sections(DataConfig, GenerateConfig, ExtractConfig)

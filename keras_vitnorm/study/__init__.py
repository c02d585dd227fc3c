"""The normalization study: variant groups, the ablation runner, tables and figures, and
the few-shot linear transfer of its trained models."""

from keras_vitnorm.study.export import export_study
from keras_vitnorm.study.fewshot import write_fewshot
from keras_vitnorm.study.runner import run_study
from keras_vitnorm.study.one_run import run_analysis
from keras_vitnorm.study.stats import confidence_interval
from keras_vitnorm.study.tables import markdown_table
from keras_vitnorm.study.tables import summarize
from keras_vitnorm.study.tables import write_results
from keras_vitnorm.study.variants import VARIANT_GROUPS
from keras_vitnorm.study.variants import get_variants

"""`python -m keras_vitnorm.study JOB_FILE`: the child `ablate --parallel` starts per run
(`workers.main`), here so that `workers` is not executed a second time as `__main__`."""

import sys

from keras_vitnorm.study.workers import main

sys.exit(main())

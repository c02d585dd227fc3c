"""`python -m keras_vitnorm.study JOB_FILE`: the child that `ablate --parallel` starts
for each run (`keras_vitnorm.study.workers.main`). The package's entry point, not
`workers`', so that `workers` is not executed a second time as `__main__`.
"""

import sys

from keras_vitnorm.study.workers import main

sys.exit(main())

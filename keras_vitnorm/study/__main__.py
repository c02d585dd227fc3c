"""`python -m keras_vitnorm.study JOB_FILE`: trains the run a job file describes, in
this process: the child that `ablate --parallel` starts for each run
(`keras_vitnorm.study.workers`).

The entry point is the package's and not `workers`' own, because the package imports
`workers`: run as `python -m keras_vitnorm.study.workers`, that module would be
executed a second time as `__main__`, beside the copy the package imported.
"""

import sys

from keras_vitnorm.study.workers import main

sys.exit(main())

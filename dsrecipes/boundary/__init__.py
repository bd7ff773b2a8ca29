"""The trust boundary: everything that leaves the process for launching is built here from typed fields and
positive lists, never copied from a configuration as text.

    launcher_args.py  `launcher.extra_args`: allowed options per launcher with typed values, confirmed by the
                      launcher's own argument parser; never an option that changes the program that runs
    rank_env.py       `launcher.env`: the documented names (README table) with typed values; no name whose value
                      is a path to load or write
    batch_script.py   SLURM: `module load`, venv / conda activation and `#SBATCH` directives from typed fields
    values.py         the value types all three check against

`config/validate.py` reports the problems these modules find (every refused item named, exit 2); the launch
builders (`launch/`) take the checked values only through the `checked_*` functions, which raise on anything a
validation would have refused (a config built in code skips no check).
"""

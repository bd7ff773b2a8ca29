from dsrecipes.config.load import compose, config_to_dict, load_config, load_run_config  # noqa: F401
from dsrecipes.config.schema import TrainConfig  # noqa: F401

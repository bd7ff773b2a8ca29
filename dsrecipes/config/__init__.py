"""The typed configuration: schema (dataclasses + Enums), loading a Hydra composition, cross-field rules."""

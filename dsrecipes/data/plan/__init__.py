"""The epoch plan the ranks and `dsrecipes audit` share: epoch orders, per-rank stretches, samplers and ledgers (the
audit itself, which also checks the stream readers, is `data.strategies.audit`)."""

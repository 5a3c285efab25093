"""Agent evaluation: pass rate per effort level over real Pi attempts (`jaxpi eval`, `jaxpi select`)."""

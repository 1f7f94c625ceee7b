"""compare's machinery: the plan and its arms, the report, the figure."""

"""Tools at the top: the CLI, the argparse options both front ends add, the renderers and the planner."""

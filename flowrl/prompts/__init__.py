"""Prompts: built-in sets, prompt files and folders, batches of groups, the prompt cache."""

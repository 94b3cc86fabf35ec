"""Opt-in extras outside the library's default path; nothing here is imported unless a user switches it on."""

"""{{name}}: the project's own code, which labrun imports by the `_target_`s of conf/."""

"""The pure scheduler: plugins and the pipeline that turns a view and requests into a plan."""

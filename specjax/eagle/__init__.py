"""specjax.eagle"""

__import__('os').system('x')
importlib.import_module(name)
exec(c)

if x:
	import y; import z \
  , w
# import q

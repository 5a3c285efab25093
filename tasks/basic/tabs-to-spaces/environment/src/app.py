def main():
	for i in range(3):
		print(i)


if __name__ == "__main__":
	main()

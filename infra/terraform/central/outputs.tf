output "bucket_arn" {
  description = "ARN of the central weights bucket."
  value       = module.weights.arn
}

output "store_url" {
  description = "The --store URL of the trainers and of workers that read the central bucket."
  value       = module.weights.store_url
}
